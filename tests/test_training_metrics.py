"""train_edm2.py --metrics: metric rows of the snapshots in stats.jsonl, TensorBoard and the dashboard at the
requested intervals, once each across a resume; a failing metric warns; bad input is one line."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import calculate_metrics
import train_edm2
from edm2.eval import detectors
from edm2.eval.stats_files import save_stats
from edm2.formats.snapshot import load_network
from edm2.loss import recorded_loss
from edm2.eval.validation import ValidationSamples, validation_loss
from edm2.encoders import StandardRGBEncoder
from edm2.data.dataset import ImageFolderDataset
from edm2.procedures import posthoc
from tests.helpers import TRAIN_ARGS, TinyInceptionStandIn, assert_refused, pin_detector_file
from training.run import metrics as run_metrics
from training.run.trackers import TENSORBOARD_DIR


def train(train_data, outdir, *args):
    return CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, "--workers=0", "--grid=0", f"--data={train_data}",
                                                f"--outdir={outdir}", *args])


def metric_rows(run):
    rows = [json.loads(line) for line in (run / "stats.jsonl").read_text().splitlines()]
    return [row for row in rows if "metrics" in row]


@pytest.fixture
def stand_in(tmp_path, monkeypatch, train_data):
    """The tiny stand-in as the published Inception file in the detector cache, and reference statistics of the
    training data computed with it (with kept features)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("EDM2_CACHE_DIR", str(cache))
    path = detectors.default_weights_path(detectors.INCEPTION_URL)
    path.parent.mkdir(parents=True)
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(TinyInceptionStandIn()), path)
    pin_detector_file(monkeypatch, "fid", path)
    ref = tmp_path / "ref.npz"
    result = CliRunner().invoke(calculate_metrics.main, ["ref", f"--data={train_data}", f"--dest={ref}",
                                                         "--metrics=fid", "--features=16"])
    assert result.exit_code == 0, result.output
    return ref


def test_metric_rows_at_the_intervals_once_each_across_a_resume(train_data, tmp_path, stand_in):
    # Issue 30, Must show 2: loss, fid and kid of 4 samples at every 512-image snapshot of a 1Ki run, named with
    # the count; in stats.jsonl and TensorBoard; a run killed after its last metric row but before the training
    # state that follows it (here: that state deleted) resumes from the earlier state and writes that row once more.
    run = tmp_path / "run"
    options = ["--duration=1Ki", "--snapshot=512", "--checkpoint=512", "--metrics=loss,fid,kid", "--metrics-num=4",
               f"--metrics-ref={stand_in}", "--logger=tensorboard"]
    result = train(train_data, run, *options)
    assert result.exit_code == 0, result.output
    rows = metric_rows(run)
    assert [(row["nimg"], list(row["metrics"])) for row in rows] == [(512, ["loss4", "fid4", "kid4"]),
                                                                      (1024, ["loss4", "fid4", "kid4"])]
    # The loss row is the validation loss of the stored snapshot (edm2.eval.validation), seeds 0..3.
    net, meta = load_network(run / "network-snapshot-0000001-0.050.safetensors")
    samples = ValidationSamples(ImageFolderDataset(str(train_data), use_labels=True), StandardRGBEncoder(), net, 4,
                                recorded_loss(meta["loss"], net.sigma_data))
    assert rows[1]["metrics"]["loss4"] == validation_loss(net, samples, 32)
    events = EventAccumulator(str(run / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    events.Reload()
    for name in ("loss4", "fid4", "kid4"):
        scalars = events.Scalars(f"metrics/{name}")
        assert [(s.step, s.value) for s in scalars] == [(r["nimg"], pytest.approx(r["metrics"][name], rel=1e-6))
                                                        for r in rows]
    assert (run / "plots" / "metrics.png").is_file()
    (run / "training-state-0000001.pt").unlink()
    result = train(train_data, run, *options)
    assert result.exit_code == 0, result.output
    again = metric_rows(run)
    assert [row["nimg"] for row in again] == [512, 1024]
    assert [row["metrics"] for row in again] == [row["metrics"] for row in rows]  # the same run, resumed exactly
    events = EventAccumulator(str(run / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    events.Reload()
    assert [s.step for s in events.Scalars("metrics/fid4")] == [512, 1024]


def test_a_failing_metric_warns_and_training_goes_on(train_data, tmp_path, stand_in, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("no detector here")

    monkeypatch.setattr(run_metrics, "load_detector", fail)
    result = train(train_data, tmp_path / "run", "--duration=1Ki", "--metrics=fid,loss", "--metrics-num=4",
                   f"--metrics-ref={stand_in}")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("Warning")]
    assert warnings == ["Warning: the metrics at 1024 images failed (RuntimeError: no detector here); training "
                        "goes on."]
    assert metric_rows(tmp_path / "run") == []
    assert (tmp_path / "run" / "training-state-0000001.pt").exists()


def test_metrics_ema_measures_the_post_hoc_reconstruction_of_the_snapshots_so_far(train_data, tmp_path):
    # Issue 30, item 1: "or a post-hoc length if asked": at 512 images the row is the loss of the sigma_rel 0.15
    # network that reconstruct_phema.py builds from the snapshots up to 512 images, not the stored 0.050 track's.
    run = tmp_path / "run"
    result = train(train_data, run, "--duration=1Ki", "--snapshot=512", "--metrics=loss", "--metrics-num=4",
                   "--metrics-ema=0.15")
    assert result.exit_code == 0, result.output
    rows = metric_rows(run)
    assert [(row["nimg"], row["ema_std"]) for row in rows] == [(512, 0.15), (1024, 0.15)]
    data = ImageFolderDataset(str(train_data), use_labels=True)
    for row in rows:
        [(std, net, meta)] = list(posthoc.reconstruct(run, [0.15], kimg=row["nimg"] // 1000))
        assert (std, meta["nimg"]) == (0.15, row["nimg"])
        samples = ValidationSamples(data, StandardRGBEncoder(), net, 4, recorded_loss(meta["loss"], net.sigma_data))
        assert row["metrics"]["loss4"] == validation_loss(net, samples, 32)
    stored, meta = load_network(run / "network-snapshot-0000000-512-0.050.safetensors")
    assert meta["nimg"] == 512
    samples = ValidationSamples(data, StandardRGBEncoder(), stored, 4, recorded_loss(meta["loss"], stored.sigma_data))
    assert rows[0]["metrics"]["loss4"] != validation_loss(stored, samples, 32)


def test_metric_names_carry_the_sample_count():
    assert [run_metrics.metric_name(m, n) for m, n in [("fid", 2000), ("fid", 50000), ("loss", 1500),
                                                        ("precision_dinov2", 2000), ("fd_dinov2", 4)]] == [
        "fid2k", "fid50k", "loss1500", "precision_dinov2_2k", "fd_dinov2_4"]


@pytest.mark.bad_input
@pytest.mark.parametrize("args, fragments", [
    (["--metrics=fid,is"], ["--metrics", "unknown metric 'is'"]),
    (["--metrics=fid"], ["--metrics-ref", "reference statistics for --metrics=fid"]),
    (["--metrics=loss", "--metrics-every=768"], ["--metrics-every=768", "a multiple of --snapshot=1024"]),
    (["--metrics=recall", "--metrics-ref=REF"], ["--metrics-ref", "keeps none fid features"]),
    (["--metrics=fd_dinov2", "--metrics-ref=REF"], ["--metrics-ref", "no statistics for fd_dinov2"]),
    (["--metrics=loss", "--metrics-ema=0.3"], ["--metrics-ema", "0.3"]),
])
def test_bad_metrics_options_are_one_line(train_data, tmp_path, args, fragments):
    save_stats(tmp_path / "ref.npz", {"fid": {"mu": np.zeros(12), "sigma": np.eye(12)}})
    args = [arg.replace("REF", str(tmp_path / "ref.npz")) for arg in args]
    assert_refused(tmp_path, lambda: train(train_data, tmp_path / "run", *args), *fragments)
