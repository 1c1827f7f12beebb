"""Every command line keeps the options it had: a user's scripts and the README keep working."""

import importlib.util
import json
import sys

import click
import pytest

from tests.helpers import DATA, REPO

SCRIPTS = ["train_edm2.py", "generate.py", "reconstruct_phema.py", "calculate_metrics.py", "dataset_tool.py",
           "count_flops.py", "toy_example.py", "plot_run.py"]


def entry_point(script: str) -> click.Command:
    """The click command `main` of a command-line script."""
    spec = importlib.util.spec_from_file_location(f"cli_options_{script[:-3]}", REPO / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.main


def option_names(command: click.Command, path: str) -> dict[str, list[str]]:
    """'script [subcommand]' -> sorted option names, for the command and each subcommand."""
    names = {path: sorted(o for p in command.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts)}
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            names.update(option_names(sub, f"{path} {name}"))
    return names


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_the_options_checked_in(script):
    expected = {k: v for k, v in json.loads((DATA / "cli_options.json").read_text()).items()
                if k.split(" ")[0] == script}
    assert option_names(entry_point(script), script) == expected
