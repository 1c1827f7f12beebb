"""README.md and its docs/ pages stay true: every command in them parses, their Python blocks run, and the
quickstart runs end to end."""

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from tests.helpers import REPO

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]


def readme_commands(pages: list[Path] = PAGES) -> list[str]:
    """Every `python ...` / `torchrun ...` line of the pages' bash blocks (README and docs/ by default),
    continuations joined."""
    text = "\n".join(page.read_text() for page in pages)
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            if line.startswith(("python ", "torchrun ")):
                commands.append(line)
    return commands


def script_and_args(command: str) -> tuple[Path, list[str]]:
    """The script a README command runs (torchrun's own options dropped) and its arguments."""
    tokens = shlex.split(command)
    start = next(i for i, token in enumerate(tokens) if token.endswith(".py"))
    return REPO / tokens[start], tokens[start + 1:]


def click_entry_point(script: Path) -> click.Command:
    """The click command of a command-line script: every script names it `main`."""
    spec = importlib.util.spec_from_file_location(f"readme_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.main


def test_readme_has_the_workflow_commands():
    # The README itself keeps the workflow's commands; the docs pages add to them.
    scripts = {script_and_args(c)[0].name for c in readme_commands([README])}
    assert {"train_edm2.py", "reconstruct_phema.py", "generate.py", "calculate_metrics.py",
            "dataset_tool.py"} <= scripts
    assert "make demo" in README.read_text()
    assert "make test" in README.read_text()


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_parses(command):
    # The ImageNet commands need GPUs, data and downloads; --help makes click check every option
    # name and subcommand of the line (unknown ones fail) and stop before running anything.
    script, args = script_and_args(command)
    assert script.is_file(), script
    result = CliRunner().invoke(click_entry_point(script), args + ["--help"], prog_name=script.name)
    assert result.exit_code == 0, f"{command}\n{result.output}"
    assert "Usage:" in result.output


def test_demo_runs_end_to_end(tmp_path):
    # scripts/demo.sh is what `make demo` runs; here on a smaller dataset and the tests' preset.
    env = dict(os.environ, PY=sys.executable, OMP_NUM_THREADS="1", DEMO_OUT=str(tmp_path / "demo"),
               DEMO_PRESET="toy-tiny", DEMO_NUM="256", DEMO_RES="8", DEMO_CLASSES="3", DEMO_SEEDS="0-7",
               DEMO_SWEEP_NUM="32")
    result = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh")], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = tmp_path / "demo"
    assert len(list((out / "phema").glob("phema-*-0.030.safetensors"))) == 1
    assert len(list((out / "phema").glob("phema-*-0.150.safetensors"))) == 1
    grids = sorted(out.glob("samples-*/grid.png"))
    assert [g.parent.name for g in grids] == ["samples-ema0.030", "samples-ema0.150",
                                              "samples-ema0.150-autoguided"]
    for grid in grids:
        with Image.open(grid) as image:
            assert image.size == (3 * 8 + 2, 3 * 8 + 2) and image.mode == "RGB"  # one-pixel gaps between 3x3
        assert str(grid) in result.stdout  # the summary says where everything is
    # Issue 11: the dashboard, the magnitudes and a sweep of the validation loss over 13 EMA lengths at the
    # middle and the end of the training (toy-tiny: snapshots at kimg 1 and 2).
    plots = out / "run" / "plots"
    for name, size in (("training.png", (880, 520)), ("magnitudes.png", (1100, 450)), ("ema-sweep.png", (500, 400))):
        with Image.open(plots / name) as image:
            assert image.format == "PNG" and image.size == size
        assert str(plots / name) in result.stdout
    rows = json.loads((plots / "ema-sweep.json").read_text())["rows"]
    assert [(row["kimg"], round(row["std"], 3)) for row in rows] == [
        (kimg, round(0.01 + 0.02 * k, 3)) for kimg in (1, 2) for k in range(13)]
    assert all(math.isfinite(row["loss"]) for row in rows)


def readme_python_block(module: str) -> str:
    """The one Python block of README.md and docs/*.md that imports from `module`."""
    blocks = re.findall(r"```python\n(.*?)```", "\n".join(page.read_text() for page in PAGES), flags=re.S)
    matching = [block for block in blocks if f"from {module} import" in block]
    assert len(matching) == 1, f"{len(matching)} Python blocks of the README and docs/ import from {module}"
    return matching[0]


def page_section(heading: str) -> str:
    """The text under the one heading (of any level) of README.md and docs/*.md that reads `heading`, up to the
    next heading."""
    sections = [text.split("\n", 1)[1].split("\n#", 1)[0] for page in PAGES
                for text in re.split(r"^(?=#+ )", page.read_text(), flags=re.M) if text.startswith("#")
                and text.split("\n", 1)[0].lstrip("#").strip() == heading]
    assert len(sections) == 1, f"{len(sections)} headings read {heading!r}"
    return sections[0]


def test_readme_python_api_runs_on_a_training_run(reference_run, tmp_path, monkeypatch):
    # The Python API's post-hoc block (docs/api.md), run as written in a folder whose training-runs/toy-small is a
    # real (toy-tiny) run.
    blocks = [readme_python_block("edm2.procedures.posthoc")]
    (tmp_path / "training-runs").mkdir()
    (tmp_path / "training-runs" / "toy-small").symlink_to(reference_run, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(blocks[0], "docs/api.md", "exec"), {"__name__": "readme"})
    lines = printed.getvalue().splitlines()
    assert [line.split()[:2] for line in lines] == [["0.03", "2048"], ["0.15", "2048"]]
    assert all(line.endswith("torch.Size([8, 3, 8, 8])") for line in lines)


def test_readme_any_model_posthoc_ema_runs(tmp_path, monkeypatch):
    # The Python API's plain-PyTorch loop (docs/api.md), run as written: ten saves of two tracks, then a synthesized
    # EMA loaded.
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}
    exec(compile(readme_python_block("edm2.procedures.anyema"), "docs/api.md", "exec"), namespace)
    saved = sorted(p.name for p in (tmp_path / "ema-snapshots").iterdir())
    assert saved == [f"ema-{step:09d}-{std}.safetensors" for step in range(100, 1001, 100) for std in ("0.050", "0.100")]
    state = namespace["synthesize"]("ema-snapshots", std=0.08)
    model = namespace["model"]
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in state.items())
    assert not torch.equal(state["0.weight"], namespace["ema"].get()[0][0].state_dict()["0.weight"])


def importable_prefix(name: str) -> tuple[object, list[str]]:
    """The longest importable module that starts the dotted name, and the attribute names after it."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:i])), parts[i:]
        except ModuleNotFoundError:
            continue
    raise AssertionError(f"{name} names no module")


def test_every_code_name_in_the_readme_exists():
    # The Python API (docs/api.md) and the table of equations (README) name modules, classes and functions as
    # `edm2.x.y`.
    sections = [page_section(heading) for heading in ("Python API", "The paper in the code")]
    names = set(re.findall(r"`((?:edm2|training|cli)\.[\w.]+)[`(]", "".join(sections)))
    missing = []
    for name in sorted(names):
        value, attributes = importable_prefix(name)
        for attribute in attributes:
            value = getattr(value, attribute, None)
        missing += [name] if value is None else []
    assert names and not missing, missing
