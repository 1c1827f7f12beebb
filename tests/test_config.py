"""--config=FILE.json: options from a file (a run's training_options.json, --dry-run output), overridden by the
command line, with unknown keys and bad values refused in one line."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import train_edm2
from tests.helpers import TRAIN_ARGS, assert_refused


def train(*args: str):
    """train_edm2.py in-process; click's result (stdout and stderr apart)."""
    return CliRunner().invoke(train_edm2.main, list(args))


def dry_run(*args: str) -> str:
    """The stdout of a successful --dry-run."""
    result = train(*args, "--dry-run")
    assert result.exit_code == 0, result.output
    return result.stdout


def write_config(path: Path, values: dict) -> Path:
    """values as a JSON file at path."""
    path.write_text(json.dumps(values))
    return path


@pytest.fixture
def options_file(train_data, tmp_path) -> Path:
    """The --dry-run output of a toy-tiny run, saved as a file."""
    path = tmp_path / "options.json"
    path.write_text(dry_run(*TRAIN_ARGS, f"--data={train_data}", f"--outdir={tmp_path / 'run'}"))
    return path


def test_training_options_of_a_run_reproduce_its_dry_run_exactly(train_data, reference_run):
    stored = reference_run / "training_options.json"
    original = dry_run(*TRAIN_ARGS, "--workers=0", f"--data={train_data}", f"--outdir={reference_run}")
    assert dry_run(f"--config={stored}") == original
    assert json.loads(original) == json.loads(stored.read_text())


def test_dry_run_output_is_a_config(options_file):
    assert dry_run(f"--config={options_file}") == options_file.read_text()


def test_command_line_overrides_the_file_and_the_file_overrides_defaults(options_file, tmp_path):
    values = json.loads(options_file.read_text())
    config = write_config(tmp_path / "branch.json", dict(values, seed=7, workers=0, lr=0.02))
    out = json.loads(dry_run(f"--config={config}", "--lr=0.003", f"--outdir={tmp_path / 'branch'}",
                             "--channel-mult=1,1"))
    assert (out["seed"], out["workers"], out["lr"]) == (7, 0, 0.003)  # defaults 0 and 2; the file's lr 0.02
    assert out["run_dir"] == str(tmp_path / "branch") and out["network"]["channel_mult"] == [1, 1]
    changed = {"seed", "workers", "lr", "run_dir", "network"}
    assert {k: v for k, v in out.items() if k not in changed} == {k: v for k, v in values.items() if k not in changed}


def test_option_names_are_keys_too(train_data, tmp_path):
    config = write_config(tmp_path / "c.json", {"preset": "toy-tiny", "data": str(train_data),
                                                "run_dir": str(tmp_path / "r"), "attn_resolutions": [],
                                                "duration": "4Ki"})
    out = json.loads(dry_run(f"--config={config}"))
    assert out["network"]["attn_resolutions"] == [] and out["duration"] == 4096


@pytest.mark.bad_input
def test_unknown_keys_are_refused_naming_them(options_file, tmp_path):
    config = write_config(tmp_path / "c.json", dict(json.loads(options_file.read_text()), lrr=1, dry_run=True))
    assert_refused(tmp_path, lambda: train(f"--config={config}"), "--config", "unknown key(s) dry_run, lrr")


@pytest.mark.bad_input
@pytest.mark.parametrize("key, value, message", [
    ("lr", -1, "lr: -1"), ("precision", "fp8", "precision: 'fp8' is not one of"),
    ("duration", "lots", "duration: 'lots' is not an image count"), ("seed", {"a": 1}, "seed: expected a value"),
    ("network", [1], "network: expected an object"),
    ("rampup_Mimg", 3, "rampup_Mimg: file has 3"),
    ("ema_stds", [0.2], "ema_stds: file has [0.2]"),
])
def test_bad_values_are_refused_naming_file_and_key(options_file, tmp_path, key, value, message):
    config = write_config(tmp_path / "c.json", dict(json.loads(options_file.read_text()), **{key: value}))
    assert_refused(tmp_path, lambda: train(f"--config={config}"), "--config", message)


@pytest.mark.bad_input
def test_a_network_the_preset_does_not_give_is_refused(options_file, tmp_path):
    values = json.loads(options_file.read_text())
    config = write_config(tmp_path / "c.json", dict(values, network=dict(values["network"], channels_per_head=8)))
    assert_refused(tmp_path, lambda: train(f"--config={config}"), "--config", "network: file has")


@pytest.mark.bad_input
@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "expected a JSON object of options, found list"), ("{", "not valid JSON"),
    ("[" * 100 + "]" * 100, "nested 100 levels deep"), (None, "No such file"),
])
def test_unreadable_files_are_refused(tmp_path, text, message):
    config = tmp_path / "c.json"
    if text is not None:
        config.write_text(text)
    assert_refused(tmp_path, lambda: train(f"--config={config}", "--preset=toy-tiny"), "--config", str(config),
                   message)
