"""--config=FILE.json: options from a file (a run's training_options.json, --dry-run output; generate.py and
calculate_metrics.py gen/sweep too), overridden by the command line, unknown keys and bad values refused in one line."""

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import calculate_metrics
import generate
import train_edm2
from edm2.encoders import StandardRGBEncoder
from edm2.formats.snapshot import save_network
from tests.helpers import TRAIN_ARGS, assert_one_error_line, assert_refused, tiny_precond, write_image_dataset


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
    # The file holds the options and, beside them, the run's identity, which is no option.
    options = json.loads(stored.read_text())
    assert re.fullmatch(r"[0-9a-f]{32}", options.pop("run_id")) and json.loads(original) == options


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


def test_ramp_up_and_ema_lengths_are_options_a_file_sets(options_file, tmp_path):
    config = write_config(tmp_path / "c.json", dict(json.loads(options_file.read_text()), rampup_Mimg=3,
                                                    ema_stds=[0.2, 0.07]))
    out = json.loads(dry_run(f"--config={config}"))
    assert (out["rampup_Mimg"], out["ema_stds"]) == (3.0, [0.07, 0.2])
    out = json.loads(dry_run(f"--config={config}", "--rampup=0", "--ema-stds=0.1"))
    assert (out["rampup_Mimg"], out["ema_stds"]) == (0.0, [0.1])


@pytest.mark.bad_input
def test_unknown_keys_are_refused_naming_them(options_file, tmp_path):
    config = write_config(tmp_path / "c.json", dict(json.loads(options_file.read_text()), lrr=1, dry_run=True))
    assert_refused(tmp_path, lambda: train(f"--config={config}"), "--config", "unknown key(s) dry_run, lrr")


@pytest.mark.bad_input
@pytest.mark.parametrize("key, value, message", [
    ("lr", -1, "lr: -1"), ("precision", "fp8", "precision: 'fp8' is not one of"),
    ("duration", "lots", "duration: 'lots' is not an image count"), ("seed", {"a": 1}, "seed: expected a value"),
    ("network", [1], "network: expected an object"),
    ("rampup_Mimg", -1, "rampup_Mimg: -1.0 is not in the range x>=0"),
    ("ema_stds", [0.2, 0.5], "ema_stds: 0.5 is outside (0, 0.2887)"),
    ("ema_stds", [0.1, 0.1004], "ema_stds: 0.1 and 0.1004 would share the file name suffix 0.100"),
    ("ema_shard", "maybe", "ema_shard: 'maybe' is not a valid boolean"),
    ("metrics", ["loss", "fd_clip"], "metrics: unknown metric 'fd_clip'; choose from fid,"),
])
def test_bad_values_are_refused_naming_file_and_key(options_file, tmp_path, key, value, message):
    config = write_config(tmp_path / "c.json", dict(json.loads(options_file.read_text()), **{key: value}))
    assert_refused(tmp_path, lambda: train(f"--config={config}"), "--config", message)


@pytest.mark.bad_input
def test_a_network_the_preset_does_not_give_is_refused(options_file, tmp_path):
    values = json.loads(options_file.read_text())
    # label_balance: a U-Net argument that is no hyperparameter, so no option sets it.
    config = write_config(tmp_path / "c.json", dict(values, network=dict(values["network"], label_balance=0.4)))
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


@pytest.fixture(scope="module")
def net(tmp_path_factory) -> Path:
    """A tiny class-conditional snapshot (5 classes, 8x8 RGB)."""
    path = tmp_path_factory.mktemp("net") / "net.safetensors"
    torch.manual_seed(0)
    save_network(path, tiny_precond(8, 3, 5).eval().requires_grad_(False), {"encoder": StandardRGBEncoder().config()})
    return path


def test_generate_reads_its_options_from_a_file_under_the_command_line(net, tmp_path):
    out = tmp_path / "out"
    config = write_config(tmp_path / "g.json", {"net": str(net), "seeds": "0-3", "class": 3, "steps": 2,
                                                "S_churn": 0, "outdir": str(out)})
    result = CliRunner().invoke(generate.main, [f"--config={config}", "--seeds=5,6"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "labels.json").read_text())["labels"] == [["000005.png", 3], ["000006.png", 3]]


@pytest.mark.bad_input
@pytest.mark.parametrize("command, values, message", [
    (["generate.py"], {"seeds": "0-3", "colour": 1}, "unknown key(s) colour"),
    (["generate.py"], {"batch": 2, "batch_size": 3}, "keys batch, batch_size set the same option"),
    (["generate.py"], {"guidance-interval": [1, 0.5]}, "guidance-interval: '1,0.5': needs 0 <= SIGMA_LO"),
    (["calculate_metrics.py", "gen"], {"num": 1}, "num: 1 is not in the range 2<=x<=100000000"),
    (["calculate_metrics.py", "sweep"], {"std": [0.5]}, "std: 0.5 is outside"),
    (["calculate_metrics.py", "sweep"], {"indir": "x", "x": 1, **{f"k{i}": i for i in range(20)}},
     "unknown key(s) k0, k1, k10, k11, k12, k13, k14, k15, k16, k17 and 11 more"),
])
def test_generate_and_metrics_refuse_bad_files(tmp_path, command, values, message):
    config = write_config(tmp_path / "c.json", values)
    main = {"generate.py": generate.main, "calculate_metrics.py": calculate_metrics.main}[command[0]]
    assert_refused(tmp_path, lambda: CliRunner().invoke(main, [*command[1:], f"--config={config}"]),
                   "--config", str(config), message)


def test_metrics_sweep_uses_the_files_metrics(tmp_path):
    config = write_config(tmp_path / "c.json", {"metrics": ["loss"], "std": [0.05, 0.1]})
    result = CliRunner().invoke(calculate_metrics.main, ["sweep", f"--config={config}", f"--indir={tmp_path}"])
    assert_one_error_line(result, "--metrics=loss needs the dataset")


@pytest.mark.parametrize("script, args", [
    (train_edm2, [*TRAIN_ARGS, "--dry-run"]), (generate, ["--steps=2", "--seeds=0"]),
    (calculate_metrics, ["sweep", "--metrics=loss", "--std=0.05"]),
])
def test_threads_sets_pytorchs_cpu_threads(script, args, train_data, net, tmp_path):
    before = torch.get_num_threads()
    wanted = before + 1  # differs from the current count whatever the machine
    extra = {train_edm2: [f"--data={train_data}", f"--outdir={tmp_path}/run"],
             generate: [f"--net={net}", f"--outdir={tmp_path}/out"],
             calculate_metrics: [f"--indir={tmp_path}", f"--data={train_data}"]}[script]
    try:
        CliRunner().invoke(script.main, [*args, *extra, f"--threads={wanted}"])
        assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)


@pytest.mark.bad_input
@pytest.mark.parametrize("value", ["0", "-1", "two", "100000"])
def test_threads_out_of_range_is_refused(value, tmp_path):
    assert_refused(tmp_path, lambda: CliRunner().invoke(generate.main, [f"--threads={value}", f"--outdir={tmp_path}"]),
                   "--threads")


@pytest.mark.bad_input
@pytest.mark.parametrize("key, value, message", [
    ("batch", 1.5, "batch: '1.5' is not"), ("batch", 32.0, "batch: '32.0' is not"),
    ("seed", True, "seed: 'true' is not"), ("duration", False, "duration: 'false' is not an image count"),
    ("ema_stds", [0.05, True], "ema_stds"),
])
def test_floats_and_booleans_for_integer_options_are_refused_as_the_command_line_refuses_them(
        options_file, tmp_path, key, value, message):
    # Python reads 1.5, 32.0 and true as the integers 1, 32 and 1; the command line refuses --batch=1.5 and --seed=true.
    config = write_config(tmp_path / "c.json", dict(json.loads(options_file.read_text()), **{key: value}))
    assert_refused(tmp_path, lambda: train(f"--config={config}"), "--config", message)


@pytest.mark.bad_input
@pytest.mark.parametrize("command", [[train_edm2.main], [generate.main], [calculate_metrics.main, "gen"]])
def test_a_key_given_twice_is_refused_not_last_one_wins(command, options_file, tmp_path):
    config = tmp_path / "c.json"
    config.write_text('{"seed": 1, "batch": 32, "seed": 2}')
    assert_refused(tmp_path, lambda: CliRunner().invoke(command[0], [*command[1:], f"--config={config}"]),
                   "--config", "the key seed appears twice")


@pytest.mark.parametrize("preset, resolution", [("toy-tiny", 16), ("toy-small", 64)])
def test_a_dry_run_on_data_without_the_presets_attention_resolution_is_accepted_back(preset, resolution, tmp_path):
    # toy-tiny attends at 4x4, which 16x16 data's two levels (16, 8) lack; toy-small at 8x8, absent from 64, 32, 16.
    data = write_image_dataset(tmp_path / "data", num=4, resolution=resolution)
    printed = dry_run(f"--preset={preset}", f"--data={data}", f"--outdir={tmp_path / 'run'}")
    config = write_config(tmp_path / "training_options.json", dict(json.loads(printed), run_id="0" * 32))
    assert dry_run(f"--config={config}") == printed
    # Typed on the command line, an attention resolution the U-Net does not have is still refused.
    [attention] = json.loads(printed)["network"]["attn_resolutions"]
    result = train(f"--preset={preset}", f"--data={data}", f"--attn-resolutions={attention}", "--dry-run")
    assert_one_error_line(result, "attention at", "but the U-Net's levels are")


def test_threads_is_stored_in_the_options_and_carried_by_config(train_data, tmp_path):
    before = torch.get_num_threads()
    wanted = before + 1
    try:
        printed = dry_run(*TRAIN_ARGS, f"--data={train_data}", f"--outdir={tmp_path / 'run'}", f"--threads={wanted}")
        assert json.loads(printed)["threads"] == wanted
        torch.set_num_threads(before)
        config = write_config(tmp_path / "c.json", json.loads(printed))
        assert dry_run(f"--config={config}") == printed and torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)
