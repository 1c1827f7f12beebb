"""Experiment trackers and sample grids while training: TensorBoard's and W&B's numbers are stats.jsonl's and the
dashboard's, a resumed run repeats no step, a failing tracker never stops training, a missing extra is one line;
one sample grid per snapshot, the same after a resume, bitwise generate.py's images; plot_run.py --tensorboard."""

import glob
import io
import json
import re
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from click.testing import CliRunner
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import generate
import plot_run
import train_edm2
from edm2.encoders import StabilityVAEEncoder
from edm2.procedures import generation
from edm2.procedures.image_grid import tile
from training.run import sample_grid, trackers
from training.run.dashboard import LOSS_MEAN_TAG, snapshot_numbers
from training.options import DEFAULT_GRID, DEFAULT_GRID_STEPS, default_grid
from training.run.sample_grid import grid_classes, grid_path
from training.run.trackers import STATUS_KEYS, TENSORBOARD_DIR, Trackers
from tests.helpers import (REPO, TRAIN_ARGS, assert_one_error_line, assert_refused, black_png, tiny_precond,
                           train_command, train_env, write_image_dataset)

LOGGERS = ("--logger=tensorboard", "--logger=wandb")


def stats_rows(run: Path) -> list[dict]:
    """stats.jsonl as a list of rows."""
    return [json.loads(line) for line in (run / "stats.jsonl").read_text().splitlines()]


def wandb_history(wandb_dir: Path) -> list[dict]:
    """The rows logged to every offline W&B run under wandb_dir, in order: W&B's run files are a LevelDB-style
    log (7-byte file header, 32 KiB blocks, records with a 7-byte header: crc32, length, type) of protobuf
    Records; history records hold the logged values as JSON."""
    from wandb.proto import wandb_internal_pb2
    rows = []
    for path in sorted(glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        data, pos, pending = Path(path).read_bytes(), 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0:
                break
            pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a whole record, or the last piece of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                 for item in record.history.item})
    return rows


def tensorboard_scalars(run: Path) -> EventAccumulator:
    """RUN/tensorboard/ read by TensorBoard's own reader (which applies purges)."""
    events = EventAccumulator(str(run / TENSORBOARD_DIR), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


@pytest.fixture(scope="module")
def tracked_run(train_data, tmp_path_factory):
    """A toy-tiny run with both trackers to 2048 images, then made to resume from its 1024-image training state
    as after a kill (later state, snapshots and grid deleted): (run, stats.jsonl of the first invocation)."""
    root = tmp_path_factory.mktemp("tracked")
    env = train_env(WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true")
    run = root / "run"
    for invocation in range(2):
        result = subprocess.run(train_command(train_data, run, "--workers=0", *LOGGERS), cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Warning" not in result.stdout + result.stderr and "Traceback" not in result.stderr
        if invocation == 0:
            first_stats = stats_rows(run)
            for path in [*run.glob("*-0000002*"), grid_path(run, 2048)]:
                path.unlink()
    return run, first_stats


def test_tensorboard_holds_stats_jsonl_once_per_step_after_a_resume(tracked_run):
    run, _ = tracked_run
    rows = stats_rows(run)
    assert [row["nimg"] for row in rows] == [512, 1024, 1536, 2048]
    events = tensorboard_scalars(run)
    for key in STATUS_KEYS:
        logged = events.Scalars(f"train/{key}")
        assert [e.step for e in logged] == [row["nimg"] for row in rows]  # the purge dropped the first 1536, 2048
        assert [e.value for e in logged] == [np.float32(row[key]) for row in rows]  # stored as float32


def test_tensorboard_holds_the_options_as_hyperparameters(tracked_run):
    from tensorboard.plugins.hparams import plugin_data_pb2
    run, _ = tracked_run
    content = tensorboard_scalars(run).PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    options = json.loads((run / "training_options.json").read_text())
    assert hparams["preset"].string_value == options["preset"] == "toy-tiny"
    assert hparams["lr"].number_value == options["lr"] and hparams["network/num_blocks"].number_value == 1
    assert json.loads(hparams["ema_stds"].string_value) == options["ema_stds"]


def test_tensorboard_holds_the_dashboards_numbers_and_the_grids(tracked_run):
    run, _ = tracked_run
    events = tensorboard_scalars(run)
    training = json.loads((run / "plots" / "training.json").read_text())
    magnitudes = json.loads((run / "plots" / "magnitudes.json").read_text())
    for levels, mags in zip(training["noise_levels"], magnitudes["rows"]):
        for tag, value in snapshot_numbers(training["sigma"], levels, mags).items():
            assert [e.value for e in events.Scalars(tag) if e.step == levels["nimg"]] == [np.float32(value)]
    images = events.Images("samples")
    assert [e.step for e in images] == [1024, 2048]
    for event in images:
        logged = np.asarray(PIL.Image.open(io.BytesIO(event.encoded_image_string)))
        assert np.array_equal(logged, np.asarray(PIL.Image.open(grid_path(run, event.step))))


def readme_tag_patterns() -> list[str]:
    """The tag names docs/dynamics.md's experiment-tracking paragraph lists, as regular expressions: upper-case
    placeholders (S, BLOCK, LAYER) stand for any text."""
    text = (REPO / "docs" / "dynamics.md").read_text()
    listed = text[text.index("under these tags:"):text.index("training options once as hyperparameters")]
    names = re.findall(r"`([^`]+)`", listed)
    assert len(names) >= 8, names
    return [re.sub(r"\b[A-Z]+\b", ".+", re.escape(name)) for name in names]


def test_readme_tag_names_are_the_ones_written(tracked_run):
    run, _ = tracked_run
    events = tensorboard_scalars(run)
    written = [*events.Tags()["scalars"], *events.Tags()["images"]]
    patterns = readme_tag_patterns()
    assert [p for p in patterns if not any(re.fullmatch(p, tag) for tag in written)] == []  # none invented
    assert [tag for tag in written if not any(re.fullmatch(p, tag) for p in patterns)] == []  # none left out


def test_wandb_offline_run_holds_the_same_numbers_once(tracked_run):
    run, first_stats = tracked_run
    history = wandb_history(run.parent)
    status = [row for row in history if "train/loss" in row]
    assert [row["kimg"] for row in status] == [row["kimg"] for row in first_stats]  # the resume repeated none
    for logged, row in zip(status, first_stats):
        assert {key: logged[f"train/{key}"] for key in STATUS_KEYS} == {key: row[key] for key in STATUS_KEYS}
    # The resumed invocation trained bit-identically: its losses are the ones W&B holds.
    assert [row["loss"] for row in stats_rows(run)] == [row["train/loss"] for row in status]
    snapshots = [row for row in history if LOSS_MEAN_TAG in row]
    assert [row["kimg"] for row in snapshots] == [1.024, 2.048]
    run_id = json.loads((run / trackers.WANDB_FILE).read_text())["id"]
    invocations = sorted(p.name for p in (run.parent / "wandb").glob("offline-run-*"))
    assert len(invocations) == 2 and all(name.endswith(f"-{run_id}") for name in invocations)  # the same W&B run


def test_one_grid_per_snapshot_identical_after_a_resume(tracked_run, reference_run):
    run, _ = tracked_run
    names = sorted(p.name for p in (run / "samples").iterdir())
    assert names == ["grid-0000001.png", "grid-0000002.png"]
    assert sorted(p.name for p in (reference_run / "samples").iterdir()) == names
    for name in names:  # grid-0000002.png of the tracked run was sampled by the resumed invocation
        assert (run / "samples" / name).read_bytes() == (reference_run / "samples" / name).read_bytes()


def test_grid_is_bitwise_what_generate_writes(reference_run, tmp_path):
    rows, cols = DEFAULT_GRID
    snapshot = reference_run / "network-snapshot-0000002-0.050.safetensors"  # the first EMA track
    images = []
    for r in range(rows):
        outdir = tmp_path / f"row{r}"
        result = CliRunner().invoke(generate.main, [
            f"--net={snapshot}", f"--seeds={r * cols}-{(r + 1) * cols - 1}", f"--class={r % 4}",
            f"--steps={DEFAULT_GRID_STEPS}", f"--outdir={outdir}"])
        assert result.exit_code == 0, result.output
        images += [np.asarray(PIL.Image.open(outdir / f"{seed:06d}.png")) for seed in range(r * cols, (r + 1) * cols)]
    grid = np.asarray(PIL.Image.open(grid_path(reference_run, 2048)))
    assert np.array_equal(grid, tile(np.stack(images), cols))


def test_grid_of_a_latent_network_is_decoded_by_its_vae(tiny_vae_dir):
    net = tiny_precond(img_channels=4, label_dim=5).eval()
    encoder = StabilityVAEEncoder(vae_name=str(tiny_vae_dir))
    grid = sample_grid.sample_grid(net, encoder, 2, 3, 2, torch.device("cpu"))
    rows = [images for r in range(2) for _, images, _ in generation.generate_images(
        net, encoder, range(3 * r, 3 * r + 3), class_idx=r, device="cpu", num_steps=2)]
    expected = tile(torch.cat(rows).permute(0, 2, 3, 1).numpy(), 3)
    assert expected.shape == (2 * 17 - 1, 3 * 17 - 1, 3)  # the tiny VAE decodes 8x8 latents to 16x16 RGB
    assert np.array_equal(grid, expected)


def train_in_process(train_data, outdir: Path, *args: str):
    """A 1024-image toy-tiny run inside this process; click's result."""
    return CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, "--duration=1Ki", "--workers=0", f"--data={train_data}",
                                                f"--outdir={outdir}", *args])


def test_grid_zero_writes_no_grid(train_data, tmp_path):
    result = train_in_process(train_data, tmp_path / "run", "--grid=0")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "network-snapshot-0000001-0.050.safetensors").exists()
    assert not (tmp_path / "run" / "samples").exists()


TRACKER_FAULTS = {  # a tracker's method, what it does, and the error the warning names
    "log raises": ("log", RuntimeError("disk on fire"), "RuntimeError: disk on fire"),
    "log calls sys.exit": ("log", SystemExit(3), "SystemExit: 3"),
    "start calls sys.exit": ("__init__", SystemExit(0), "SystemExit: 0"),  # before any result: nothing undone
}


@pytest.mark.parametrize("fault", TRACKER_FAULTS)
def test_a_tracker_that_raises_or_exits_does_not_stop_or_undo_training(fault, train_data, tmp_path, monkeypatch):
    method, error, named = TRACKER_FAULTS[fault]

    def fail(*args):
        raise error

    monkeypatch.setattr(trackers.TensorBoardTracker, method, fail)
    result = train_in_process(train_data, tmp_path / "run", "--logger=tensorboard", "--grid=0")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("Warning")]
    assert warnings == [f"Warning: the tensorboard tracker failed ({named}); training goes on without it."]
    assert [row["nimg"] for row in stats_rows(tmp_path / "run")] == [512, 1024]
    assert (tmp_path / "run" / "training-state-0000001.pt").exists()


def test_a_failing_sample_grid_does_not_stop_training(train_data, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("cannot load the VAE")

    monkeypatch.setattr(sample_grid, "sample_batch", fail)
    result = train_in_process(train_data, tmp_path / "run", "--snapshot=512")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("Warning")]
    assert warnings == ["Warning: the sample grid failed (OSError: cannot load the VAE); training goes on without "
                        "grids."]  # once, though two snapshots were written
    assert (tmp_path / "run" / "network-snapshot-0000001-0.050.safetensors").exists()
    assert not list((tmp_path / "run").glob("samples/*"))


def test_trackers_drop_only_the_one_that_raises(tmp_path, capsys):
    logged = []

    class Good:
        name = "good"

        def log(self, *args):
            logged.append(args)

    class Bad(Good):
        name = "bad"

        def log(self, *args):
            raise OSError(28, "No space left on device")

    group = Trackers((), tmp_path, {}, 0)
    group.trackers = [Bad(), Good()]
    group.log("status", 512, {"train/loss": 1.0})
    group.log("status", 1024, {"train/loss": 0.5})
    assert [t.name for t in group.trackers] == ["good"]
    assert logged == [("status", 512, {"train/loss": 1.0}, {}), ("status", 1024, {"train/loss": 0.5}, {})]
    assert capsys.readouterr().out.count("Warning: the bad tracker failed") == 1


def test_a_tracker_failing_in_its_own_thread_is_one_warning_line_without_traceback(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # Python's, not pytest's catcher
    group = Trackers(("tensorboard",), tmp_path, {}, 0)
    [tracker] = group.trackers
    records = tracker.writer.file_writer.event_writer._async_writer._writer  # written by TensorBoard's own thread

    def full_disk(data):
        raise OSError(28, "No space left on device")

    records.write = full_disk
    group.log("status", 512, {"train/loss": 1.0})
    group.flush()
    group.log("status", 1024, {"train/loss": 0.5})
    group.close()
    tracker.writer.file_writer.event_writer._async_writer._worker.join()  # its thread has ended, hook included
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and group.trackers == [], out + err
    assert (out + err).splitlines() == ["Warning: the tensorboard tracker failed (OSError: No space left "
                                        "on device); training goes on without it."]


@pytest.mark.bad_input
@pytest.mark.parametrize("name, module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_missing_extra_is_one_line(name, module, train_data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # import then raises ImportError, as when not installed
    assert_refused(tmp_path, lambda: train_in_process(train_data, tmp_path / "run", f"--logger={name}"),
                   f"--logger={name}", f"pip install -e .[{name}]")


@pytest.mark.bad_input
@pytest.mark.parametrize("args, option, message", [
    (["--logger=mlflow"], "--logger", "'mlflow' is not one of"),
    (["--grid=4by8"], "--grid", "not ROWSxCOLS"),
    (["--grid=0x8"], "--grid", "must each be 1 to 64"),
    (["--grid=65x1"], "--grid", "must each be 1 to 64"),
    (["--grid-steps=0"], "--grid-steps", "not in the range"),
    (["--grid-steps=1001"], "--grid-steps", "not in the range"),
])
def test_bad_tracking_option(args, option, message, train_data, tmp_path):
    assert_refused(tmp_path, lambda: train_in_process(train_data, tmp_path / "run", *args), option, message)


def test_plot_run_tensorboard_writes_a_runs_records_as_events(reference_run, tmp_path):
    run = tmp_path / "copied"
    shutil.copytree(reference_run, run)
    result = CliRunner().invoke(plot_run.main, [str(run), "--tensorboard"])
    assert result.exit_code == 0, result.output
    events = tensorboard_scalars(run)
    rows = stats_rows(run)
    for key in STATUS_KEYS:
        assert [(e.step, e.value) for e in events.Scalars(f"train/{key}")] == [
            (row["nimg"], np.float32(row[key])) for row in rows]
    training = json.loads((run / "plots" / "training.json").read_text())
    assert [e.step for e in events.Scalars(LOSS_MEAN_TAG)] == [r["nimg"] for r in training["noise_levels"]]
    assert [e.step for e in events.Images("samples")] == [1024, 2048]
    again = CliRunner().invoke(plot_run.main, [str(run), "--tensorboard"])  # replaces, never duplicates
    assert again.exit_code == 0, again.output
    assert len(tensorboard_scalars(run).Scalars("train/loss")) == len(rows)


@pytest.mark.bad_input
def test_plot_run_tensorboard_needs_a_run_and_the_extra(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    assert_refused(tmp_path, lambda: CliRunner().invoke(plot_run.main, [str(tmp_path / "empty"), "--tensorboard"]),
                   "RUN", "stats.jsonl")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert_refused(tmp_path, lambda: CliRunner().invoke(plot_run.main, [str(tmp_path / "empty"), "--tensorboard"]),
                   "--tensorboard", "pip install -e .[tensorboard]")


@pytest.mark.bad_input
def test_plot_run_tensorboard_with_a_damaged_options_file_is_one_line(reference_run, tmp_path):
    run = tmp_path / "copied"
    shutil.copytree(reference_run, run)
    (run / "training_options.json").write_text("[1, 2]")
    assert_refused(tmp_path, lambda: CliRunner().invoke(plot_run.main, [str(run), "--tensorboard"]),
                   "RUN", f"{run / 'training_options.json'}: a JSON list, not an object")


def _without(run: Path, name: str, key: str, value=None) -> None:
    """Set (or with value None remove) one key of a plots/ record file."""
    path = run / "plots" / name
    records = json.loads(path.read_text())
    if value is None:
        records.pop(key)
    else:
        records[key] = value
    path.write_text(json.dumps(records))


DAMAGED_RECORDS = {
    "training.json without sigma": (lambda run: _without(run, "training.json", "sigma"), "malformed records"),
    "sigma of strings": (lambda run: _without(run, "training.json", "sigma", ["a", "b"]), "malformed records"),
    "noise_levels an object": (lambda run: _without(run, "training.json", "noise_levels", {"a": 1}),
                               "malformed records"),
    "a decompression-bomb grid": (lambda run: grid_path(run, 2048).write_bytes(black_png(20000, 20000)),
                                  "not a readable PNG"),
    "a full disk": (None, "cannot write (No space left on device)"),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("damage", DAMAGED_RECORDS)
def test_plot_run_tensorboard_on_damaged_records_or_a_full_disk_is_one_line_and_writes_nothing(
        damage, reference_run, tmp_path, monkeypatch):
    run = tmp_path / "copied"
    shutil.copytree(reference_run, run, ignore=shutil.ignore_patterns(TENSORBOARD_DIR))
    assert CliRunner().invoke(plot_run.main, [str(run), "--tensorboard"]).exit_code == 0
    before = {p.name: p.read_bytes() for p in (run / TENSORBOARD_DIR).iterdir()}
    spoil, message = DAMAGED_RECORDS[damage]
    if spoil is None:
        from tensorboard.summary.writer.record_writer import RecordWriter
        real_write = RecordWriter.write

        def full_after_some(self, data):
            if getattr(self, "written", 0) == 5:
                raise OSError(28, "No space left on device")
            self.written = getattr(self, "written", 0) + 1
            real_write(self, data)
        monkeypatch.setattr(RecordWriter, "write", full_after_some)
    else:
        spoil(run)
    result = CliRunner().invoke(plot_run.main, [str(run), "--tensorboard"])
    assert_one_error_line(result, "RUN", message)
    # The earlier event file is all TensorBoard finds: no partial file hides its events, no temporary is left.
    assert {p.name: p.read_bytes() for p in (run / TENSORBOARD_DIR).iterdir()} == before
    assert len(tensorboard_scalars(run).Scalars("train/loss")) == len(stats_rows(run))


def test_the_default_grid_shows_every_class_and_a_smaller_one_says_which(tmp_path):
    # Issue 26, item 8: the default 4x8 grid showed 4 of 9 classes with no hint.
    assert [default_grid(n) for n in (0, 4, 9, 40)] == [(4, 8), (4, 8), (9, 4), (16, 4)]
    data = write_image_dataset(tmp_path / "six", num=18, classes=6)
    common = [*TRAIN_ARGS, f"--data={data}", "--duration=16", "--batch=16", "--workers=0", "--grid-steps=1"]
    dry = CliRunner().invoke(train_edm2.main, [*common, f"--outdir={tmp_path / 'dry'}", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.stdout)["grid"] == [6, 5]  # a row per class
    unconditional = CliRunner().invoke(train_edm2.main, [*common, f"--outdir={tmp_path / 'u'}", "--cond=False", "-n"])
    assert json.loads(unconditional.stdout)["grid"] == list(DEFAULT_GRID)
    smaller = CliRunner().invoke(train_edm2.main, [*common, f"--outdir={tmp_path / 'run'}", "--grid=4x2"])
    assert smaller.exit_code == 0, smaller.output
    assert "The sample grids show classes 0-3 of 6 (one per row); --grid=6xCOLS shows every class." in smaller.output
    assert grid_classes(9, 9) == grid_classes(4, 0) == ""
