"""The fixed, named validation loss (--validation-loss): runs trained with another loss weighting or noise
distribution, measured by the same fixed loss, give the numbers of one formula, computed by hand; the default is
each run's own loss, as before; every row records the loss it measured; an unknown name is one line. In the sweep,
the tensor sweep, the training metrics and the dashboard's loss per noise level."""

import json
import shutil

import safetensors.torch

import PIL.Image
import numpy as np
import pytest
import torch
from click.testing import CliRunner

import calculate_metrics
import train_edm2
from edm2 import loss as loss_module
from edm2.data.dataset import ImageFolderDataset
from edm2.encoders import StandardRGBEncoder
from edm2.eval.validation import OWN, VALIDATION_LOSSES, ValidationError, measured_loss, sigma_grid
from edm2.formats.snapshot import load_network, read_metadata
from tests.helpers import TRAIN_ARGS, assert_refused, validation_loss_by_hand, toy_tiny_options
from training.options import OptionsError
from training.run import metrics as run_metrics
from training.run.dashboard import PROBE_IMAGES, Dashboard

NUM, SEED = 8, 3
# A run that changed both: another weighting (the test's), its uncertainty off, and another noise distribution.
CHANGED = dict(weighting="inverse-sigma2", uncertainty="off", P_mean=-1.2, P_std=2.0)


def inverse_sigma2(sigma, sigma_data):
    """A weighting unlike Eq. 15's: lambda(sigma) = 1 / sigma^2."""
    return 1 / sigma**2


def record(name, P_mean, P_std, weighting="edm2"):
    return dict(name=name, weighting=weighting, noise="log-normal", P_mean=P_mean, P_std=P_std)


@pytest.fixture
def changed_weighting(monkeypatch):
    """CHANGED's weighting, registered in edm2.loss.WEIGHTINGS for this test."""
    monkeypatch.setitem(loss_module.WEIGHTINGS, CHANGED["weighting"],
                        loss_module.Weighting(inverse_sigma2, about="1 / sigma^2, a test's"))


def copy_recording(run, dest, loss):
    """A copy of a run's snapshots whose metadata records this loss: the same weights, trained by another loss."""
    dest.mkdir()
    for path in run.glob("network-snapshot-*.safetensors"):
        metadata = read_metadata(path)
        metadata["loss"] = dict(metadata["loss"], **loss)
        safetensors.torch.save_file(safetensors.torch.load_file(str(path)), str(dest / path.name),
                                    metadata={"edm2": json.dumps(metadata)})
    return dest


def sweep(indir, train_data, dest, *args):
    return CliRunner().invoke(calculate_metrics.main, [
        "sweep", f"--indir={indir}", "--std=0.1", "--kimg=2", "--metrics=loss", f"--data={train_data}",
        f"--num={NUM}", f"--batch={NUM}", f"--seed={SEED}", f"--dest={dest}", *args])


def test_runs_of_other_losses_measured_by_one_fixed_loss_compare(reference_run, train_data, tmp_path,
                                                                 changed_weighting):
    # The same weights recorded as trained by EDM2's loss (toy-tiny: ln(sigma) ~ N(-0.8, 1.6^2)) and by CHANGED.
    changed = copy_recording(reference_run, tmp_path / "changed", CHANGED)
    rows = {}
    for run in ("reference", "changed"):
        for name in (OWN, "edm2", "edm2-64"):
            indir = reference_run if run == "reference" else changed
            dest = tmp_path / f"{run}-{name}"
            result = sweep(indir, train_data, dest, *([] if name == OWN else [f"--validation-loss={name}"]),
                           f"--save={tmp_path / 'saved' / run / name}")
            assert result.exit_code == 0, result.output
            stored = json.loads((dest / "ema-sweep.json").read_text())
            assert ("validation_loss" in stored["settings"]) == (name != OWN)  # the default's file is as before
            [rows[run, name]] = stored["rows"]
    [saved] = (tmp_path / "saved" / "changed" / OWN).glob("*.safetensors")
    net = load_network(saved)[0]
    # Each number against Eq. 14 by hand (tests.helpers): the same float32 outputs, float64 sums in another order.
    by_hand = {
        ("reference", OWN): validation_loss_by_hand(net, train_data, NUM, SEED, -0.8, 1.6),
        ("changed", OWN): validation_loss_by_hand(net, train_data, NUM, SEED, -1.2, 2.0, weight=inverse_sigma2),
        **{(run, "edm2"): validation_loss_by_hand(net, train_data, NUM, SEED, -0.4, 1.0)
           for run in ("reference", "changed")},
        **{(run, "edm2-64"): validation_loss_by_hand(net, train_data, NUM, SEED, -0.8, 1.6)
           for run in ("reference", "changed")},
    }
    for key, expected in by_hand.items():
        assert rows[key]["loss"] == pytest.approx(expected, rel=1e-10), key
    # The runs' own losses are two formulas; a fixed one is one formula for both.
    assert abs(rows["changed", OWN]["loss"] / rows["reference", OWN]["loss"] - 1) > 0.05
    assert rows["changed", "edm2"]["loss"] == rows["reference", "edm2"]["loss"]
    # Every row records the loss it measured, the default by its name 'own' and the run's formula.
    assert rows["reference", OWN]["validation_loss"] == record(OWN, -0.8, 1.6)
    assert rows["changed", OWN]["validation_loss"] == record(OWN, -1.2, 2.0, weighting=CHANGED["weighting"])
    for run in ("reference", "changed"):
        assert rows[run, "edm2"]["validation_loss"] == record("edm2", -0.4, 1.0)
        assert rows[run, "edm2-64"]["validation_loss"] == record("edm2-64", -0.8, 1.6)

    # A rerun into a results file of another validation loss is refused, naming the setting; nothing is written.
    dest = tmp_path / "changed-edm2"
    assert_refused(dest, lambda: sweep(changed, train_data, dest, "--validation-loss=edm2-64"),
                   "--dest", "other settings", "validation_loss")


def test_the_tensor_sweep_measures_and_records_the_fixed_loss(reference_run, train_data, tmp_path):
    results = {}
    for name in (OWN, "edm2"):
        dest = tmp_path / name
        result = CliRunner().invoke(calculate_metrics.main, [
            "tensor-sweep", f"--indir={reference_run}", "--global-std=0.1", "--std=0.05", "--tensors=buckets",
            f"--data={train_data}", f"--num={NUM}", f"--batch={NUM}", f"--seed={SEED}", f"--dest={dest}",
            *([] if name == OWN else [f"--validation-loss={name}"])])
        assert result.exit_code == 0, result.output
        results[name] = json.loads((dest / "ema-tensor-sweep.json").read_text())
    assert "validation_loss" not in results[OWN]["settings"]
    assert results["edm2"]["settings"]["validation_loss"] == "edm2"
    for name, (P_mean, P_std) in ((OWN, (-0.8, 1.6)), ("edm2", (-0.4, 1.0))):
        assert all(row["validation_loss"] == record(name, P_mean, P_std) for row in results[name]["rows"])
    # The baseline (every tensor at --global-std) is the sweep's network; its two losses are two formulas.
    baseline = {name: next(row for row in results[name]["rows"] if row["tensor"] is None and row["std"] == 0.1)
                for name in results}
    assert baseline[OWN]["loss"] != baseline["edm2"]["loss"]


def test_the_training_metric_measures_the_fixed_loss_and_records_it(reference_run, train_data, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for path in reference_run.glob("network-snapshot-*.safetensors"):
        shutil.copy(path, run)
    dataset = ImageFolderDataset(str(train_data), use_labels=True)
    rows = {}
    for name in (OWN, "edm2"):
        # The run changed its noise distribution (P_mean); the fixed loss does not follow it.
        opts = toy_tiny_options(run_dir=str(run), data=str(train_data), metrics=("loss",), metrics_num=NUM,
                                P_mean=-1.2, validation_loss=name)
        rows[name] = run_metrics.RunMetrics(opts, dataset, StandardRGBEncoder(), torch.device("cpu")).measure(2048)
    net = load_network(run / "network-snapshot-0000002-0.050.safetensors")[0]  # toy-tiny's first track
    own = validation_loss_by_hand(net, train_data, NUM, 0, -1.2, 1.6)
    fixed = validation_loss_by_hand(net, train_data, NUM, 0, -0.4, 1.0)
    assert rows[OWN]["metrics"] == {"loss8": pytest.approx(own, rel=1e-10)}  # the default, named as before
    assert rows["edm2"]["metrics"] == {"loss_edm2_8": pytest.approx(fixed, rel=1e-10)}
    assert rows[OWN]["validation_loss"] == record(OWN, -1.2, 1.6)
    assert rows["edm2"]["validation_loss"] == record("edm2", -0.4, 1.0)


def probe_by_hand(train_data, net, sigmas):
    """lambda(sigma) L(D; sigma) of Eq. 15 at each sigma on the dashboard's probe batch, written from its description:
    PROBE_IMAGES images evenly spaced, sample i's generator (seed i) drawing ln(sigma) (one normal) and then n."""
    names = sorted(p.relative_to(train_data).as_posix() for p in train_data.rglob("*.png"))
    labels_of = dict(json.loads((train_data / "dataset.json").read_text())["labels"])
    picked = [names[i * len(names) // PROBE_IMAGES] for i in range(PROBE_IMAGES)]
    pixels = np.stack([np.asarray(PIL.Image.open(train_data / name)) for name in picked])
    y = torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous().float() / 127.5 - 1
    labels = torch.nn.functional.one_hot(torch.tensor([labels_of[name] for name in picked]), 4).float()
    draws = [torch.Generator().manual_seed(i) for i in range(PROBE_IMAGES)]
    for g in draws:
        torch.randn([], generator=g)
    noise = torch.stack([torch.randn([3, 8, 8], generator=g) for g in draws])
    errors = []
    for s in sigmas:
        with torch.no_grad():
            denoised = net(y + s * noise, s, labels).double()
        errors.append((s**2 + 0.25) / (s * 0.5) ** 2 * (denoised - y.double()).square().mean().item())
    return errors


def test_the_dashboards_loss_per_noise_level_follows_the_fixed_loss(reference_run, train_data, tmp_path):
    net = load_network(next(reference_run.glob("network-snapshot-0000002-*.safetensors")))[0].eval()
    dataset = ImageFolderDataset(str(train_data), use_labels=True)
    records = {}
    for name in (OWN, "edm2"):
        run = tmp_path / name
        run.mkdir()
        opts = toy_tiny_options(run_dir=str(run), data=str(train_data), P_mean=-1.2, P_std=2.0, validation_loss=name)
        dashboard = Dashboard(run, opts, dataset, StandardRGBEncoder(), net, torch.device("cpu"), cur_nimg=0)
        dashboard.update(net, 2048)
        records[name] = json.loads((run / "plots" / "training.json").read_text())
    # The default: the run's own noise levels, and no name recorded, as in earlier records.
    assert "validation_loss" not in records[OWN]
    assert records[OWN]["sigma"] == pytest.approx(sigma_grid(-1.2, 2.0), rel=1e-15)
    assert (records["edm2"]["validation_loss"], records["edm2"]["P_mean"], records["edm2"]["P_std"]) == ("edm2", -0.4,
                                                                                                           1.0)
    assert records["edm2"]["sigma"] == pytest.approx(sigma_grid(-0.4, 1.0), rel=1e-15)
    for name in records:
        errors = records[name]["noise_levels"][0]["weighted_error"]
        # Same float32 network on the same batch; float64 means of 8 * 192 terms differ only in order.
        assert errors == pytest.approx(probe_by_hand(train_data, net, records[name]["sigma"]), rel=1e-12)


@pytest.mark.bad_input
def test_an_unknown_validation_loss_is_one_line(reference_run, train_data, tmp_path):
    known = list(VALIDATION_LOSSES)
    commands = {
        "sweep": lambda: sweep(reference_run, train_data, tmp_path / "out", "--validation-loss=inverse-sigma2"),
        "tensor-sweep": lambda: CliRunner().invoke(calculate_metrics.main, [
            "tensor-sweep", f"--indir={reference_run}", "--global-std=0.1", "--std=0.05", f"--data={train_data}",
            f"--dest={tmp_path / 'out'}", "--validation-loss=inverse-sigma2"]),
        "train": lambda: CliRunner().invoke(train_edm2.main, [
            *TRAIN_ARGS, f"--data={train_data}", f"--outdir={tmp_path / 'run'}", "--metrics=loss",
            "--validation-loss=inverse-sigma2"]),
    }
    for command, invoke in commands.items():
        assert_refused(tmp_path, invoke, "--validation-loss", "inverse-sigma2", *known)


@pytest.mark.bad_input
def test_an_unknown_validation_loss_in_python_names_the_table():
    own = loss_module.EDM2Loss(-0.8, 1.6)
    with pytest.raises(ValidationError, match=r"'inverse-sigma2' is not registered \(known: own, edm2, edm2-64\)"):
        measured_loss("inverse-sigma2", own)
    with pytest.raises(OptionsError, match=r"--validation-loss='inverse-sigma2': expected one of own, edm2, edm2-64"):
        toy_tiny_options(validation_loss="inverse-sigma2")
    # The default is the run's own loss itself; a fixed one keeps only the run's sigma_data and uncertainty.
    assert measured_loss(OWN, own) is own
    fixed = measured_loss("edm2", loss_module.EDM2Loss(-1.2, 2.0, 0.25, uncertainty="off"))
    assert (fixed.record(), fixed.sigma_data) == (dict(weighting="edm2", noise="log-normal", uncertainty="off",
                                                       P_mean=-0.4, P_std=1.0), 0.25)
