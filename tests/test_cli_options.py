"""Every command line keeps the options it had: a user's scripts and the README keep working."""

import functools
import importlib.util
import json
import sys

import click
import pytest
from click.testing import CliRunner

from cli.types import ImageCount, IntList, Resolution, SeedList
from tests.helpers import DATA, REPO, assert_one_error_line

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


# Types of integer options besides click's own: each has finite bounds `min` and `max`.
INTEGER_TYPES = (click.types.IntParamType, ImageCount, IntList, SeedList, Resolution)


def commands(command: click.Command, path: list[str]):
    """(argument path, command) for a command and each subcommand."""
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from commands(sub, [*path, name])


@functools.cache
def entry_points() -> dict[str, click.Command]:
    """Every script's command, loaded once."""
    return {script: entry_point(script) for script in SCRIPTS}


def integer_options() -> list[tuple[str, list[str], str]]:
    """(script, subcommand path, option name) of every option that takes integers, in every command."""
    found = []
    for script, main in entry_points().items():
        for path, command in commands(main, []):
            found += [(script, path, p.opts[0]) for p in command.params
                      if isinstance(p, click.Option) and isinstance(p.type, INTEGER_TYPES)]
    return found


def option(script: str, path: list[str], name: str) -> click.Option:
    """The click option `name` of `script path`."""
    command = entry_points()[script]
    for sub in path:
        command = command.commands[sub]
    return next(p for p in command.params if isinstance(p, click.Option) and p.opts[0] == name)


def test_every_option_that_takes_a_number_is_found():
    # The walk below must see the options the issue named (and with them every other integer option).
    found = {(script, " ".join(path), name) for script, path, name in integer_options()}
    assert {("generate.py", "", "--batch"), ("generate.py", "", "--steps"), ("train_edm2.py", "", "--duration"),
            ("train_edm2.py", "", "--seed"), ("train_edm2.py", "", "--channels"), ("toy_example.py", "train", "--dim"),
            ("dataset_tool.py", "toy", "--resolution"), ("dataset_tool.py", "convert", "--resolution")} <= found
    assert len(found) >= 35


@pytest.mark.parametrize("script, path, name", integer_options(),
                         ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_every_integer_option_has_a_finite_range(script, path, name):
    param = option(script, path, name)
    assert isinstance(param.type.min, int) and isinstance(param.type.max, int)
    assert param.type.min < param.type.max < 2**53
    param.type.convert(str(param.type.max), param, None)  # the bounds themselves are accepted


@pytest.mark.bad_input
@pytest.mark.parametrize("value", ["9" * 5000, "1" + "0" * 400, "max + 1", "min - 1"])
@pytest.mark.parametrize("script, path, name", integer_options(),
                         ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_every_integer_option_refuses_numbers_out_of_range_in_one_line(tmp_path, monkeypatch, script, path, name,
                                                                       value):
    # --batch=10**20 overflowed islice, --duration of 5,000 digits gave a traceback, --steps=10**10 hung.
    param = option(script, path, name)
    bound = {"max + 1": param.type.max + 1, "min - 1": param.type.min - 1}
    if value == "min - 1" and bound[value] < 0:
        value = "-1"  # a list of seeds or sizes has no minus sign: refused as text
    monkeypatch.chdir(tmp_path)  # nothing may be written, here or anywhere
    result = CliRunner().invoke(entry_points()[script], [*path, f"{name}={bound.get(value, value)}"])
    assert_one_error_line(result, name)
    assert list(tmp_path.iterdir()) == []
