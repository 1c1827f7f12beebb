"""docs/extending.md's examples, applied to the one file each names and run end to end: a solver (its order, its
evaluations, generate.py) and a loss weighting (train_edm2.py with the uncertainty off, the snapshot's record,
calculate_metrics.py sweep against a computation by hand); and the loss records' bad input."""

import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

import calculate_metrics
import generate
import train_edm2
from edm2 import loss as loss_module
from edm2 import sampler
from edm2 import solvers as solvers_module
from edm2.encoders import StandardRGBEncoder
from edm2.eval import benchmark
from edm2.eval.validation import loss_per_sigma
from edm2.formats.snapshot import load_network, read_metadata, save_network
from edm2.procedures.generation import generate_images
from scripts.extension_examples import blocks, section, with_example
from training.options import OptionsError, OptionsMismatch, check_same_hyperparameters
from tests.helpers import (REPO, TRAIN_ARGS, assert_refused, count_macs, read_pngs, tiny_precond, toy_tiny_options,
                           validation_loss_by_hand)


def apply_example(module: types.ModuleType, title: str, table: str, monkeypatch) -> tuple[str, types.ModuleType]:
    """Edit module's file as docs/extending.md says (scripts/extension_examples.py: the function before the table,
    the row first in it), load the edited file as a module, and add its new row to the live table for this test.
    Returns the row's name and the module."""
    path, function, row = blocks(section((REPO / "docs" / "extending.md").read_text(), title))
    assert REPO / path == Path(module.__file__)
    edited = with_example(Path(module.__file__).read_text(), function, row, table)
    extended = types.ModuleType(module.__name__ + "_extended")
    monkeypatch.setitem(sys.modules, extended.__name__, extended)  # dataclasses look their module up there
    exec(compile(edited, module.__file__, "exec"), extended.__dict__)
    [name] = set(getattr(extended, table)) - set(getattr(module, table))
    monkeypatch.setitem(getattr(module, table), name, getattr(extended, table)[name])
    return name, extended


def test_the_readmes_solver_is_second_order_counted_and_samples_through_generate(monkeypatch, tmp_path):
    name, _ = apply_example(solvers_module, "A solver", "SOLVERS", monkeypatch)
    assert name == "midpoint"
    # Its order on the PF-ODE of data N(0, s^2): D(x; sigma) = x s^2 / (s^2 + sigma^2), and x(sigma) is proportional
    # to sqrt(s^2 + sigma^2). Every solver's last step is D at sigma_min, so the reference takes it from the exact x.
    s, noise = 0.5, torch.linspace(-2, 2, 9, dtype=torch.float64).reshape(-1, 1, 1, 1)

    def denoiser(x, sigma, labels=None):
        return x * s**2 / (s**2 + sigma.reshape(-1, 1, 1, 1) ** 2)

    exact = noise * 80 * math.sqrt(s**2 + 0.002**2) / math.sqrt(s**2 + 80**2)
    reference = denoiser(exact, torch.tensor([0.002]))
    errors = [(sampler.edm_sampler(denoiser, noise, num_steps=n, dtype=torch.float64, solver=name) - reference)
              .abs().max().item() for n in (16, 32, 64)]
    slopes = [math.log2(a / b) for a, b in zip(errors, errors[1:])]
    assert all(1.8 < s < 2.3 for s in slopes), slopes
    # Its row's evaluations are the calls it makes.
    calls = []
    sampler.edm_sampler(lambda x, s, labels=None: calls.append(1) or torch.zeros_like(x), torch.zeros([1, 1, 2, 2]),
                        num_steps=16, solver=name)
    assert len(calls) == sampler.evaluations(name, 16) == 31
    # generate.py offers it and writes what the library samples with it; churn applies (its row says so).
    net_path = tmp_path / "net.safetensors"
    torch.manual_seed(0)
    net = tiny_precond(label_dim=5).eval().requires_grad_(False)
    save_network(net_path, net, {"encoder": StandardRGBEncoder().config()})
    assert benchmark.sampling_flops_per_image(net, None, 16, name) == 2.0 * count_macs(net) * 31
    args = [f"--net={net_path}", "--seeds=0-2", "--steps=4", "--S_churn=5", "--S_max=10"]
    for solver in (name, "heun"):
        result = CliRunner().invoke(generate.main, [*args, f"--solver={solver}", f"--outdir={tmp_path / solver}"])
        assert result.exit_code == 0, result.output
    [(_, images, _)] = generate_images(load_network(net_path)[0], StandardRGBEncoder(), range(3), num_steps=4,
                                       S_churn=5, S_max=10, solver=name, batch_size=3, device="cpu")
    written = read_pngs(tmp_path / name)
    assert all(np.array_equal(image.permute(1, 2, 0).numpy(), png) for image, png in zip(images, written.values()))
    assert written.keys() == read_pngs(tmp_path / "heun").keys()
    assert any(not np.array_equal(a, b) for a, b in zip(written.values(), read_pngs(tmp_path / "heun").values()))


def test_a_run_trained_with_the_readmes_weighting_is_validated_with_it(train_data, tmp_path, monkeypatch):
    name, extended = apply_example(loss_module, "A loss weighting", "WEIGHTINGS", monkeypatch)
    assert name == "min-snr"
    run = tmp_path / "run"
    result = CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, "--workers=0", "--duration=512", "--snapshot=512",
                                                  "--checkpoint=512", "--grid=0", f"--data={train_data}",
                                                  f"--outdir={run}", f"--loss-weighting={name}",
                                                  "--uncertainty=off"])
    assert result.exit_code == 0, result.output
    [snapshot] = run.glob("network-snapshot-*-0.100.safetensors")
    metadata = read_metadata(snapshot)
    assert metadata["loss"] == dict(weighting=name, noise="log-normal", uncertainty="off", P_mean=-0.8,
                                    P_std=1.6)  # toy-tiny's
    options = json.loads((run / "training_options.json").read_text())
    assert (options["loss_weighting"], options["uncertainty"]) == (name, "off")
    # The dashboard's loss per noise level: lambda(sigma) L(D; sigma) with the run's weighting, and no u.
    training = json.loads((run / "plots" / "training.json").read_text())
    assert (training["weighting"], training["uncertainty"]) == (name, "off")
    assert all("u" not in row for row in training["noise_levels"])
    # Must show 2: the sweep's validation loss is the one computed by hand with the run's weighting.
    num = 24
    result = CliRunner().invoke(calculate_metrics.main, [
        "sweep", f"--indir={run}", "--std=0.1", "--metrics=loss", f"--data={train_data}", f"--num={num}",
        f"--batch={num}", "--seed=5", f"--dest={tmp_path / 'out'}", f"--save={tmp_path / 'saved'}"])
    assert result.exit_code == 0, result.output
    [row] = json.loads((tmp_path / "out" / "ema-sweep.json").read_text())["rows"]
    [saved] = (tmp_path / "saved").glob("*.safetensors")
    net = load_network(saved)[0]
    expected = validation_loss_by_hand(net, train_data, num, 5, -0.8, 1.6, weight=extended.min_snr_weight)
    # The same float32 network outputs on the same batch; only the float64 sums' order differs.
    assert row["loss"] == pytest.approx(expected, rel=1e-10)
    # EDM2's weighting gives another number: the comparison tells the weightings apart.
    assert validation_loss_by_hand(net, train_data, num, 5, -0.8, 1.6) > 1.05 * expected


def copy_with_loss(run, dest, loss):
    """A copy of a run's snapshots whose metadata records this loss (None: no record of names, as before them)."""
    dest.mkdir()
    for path in run.glob("network-snapshot-*.safetensors"):
        metadata = read_metadata(path)
        metadata["loss"] = {k: v for k, v in metadata["loss"].items() if k in ("P_mean", "P_std")}
        metadata["loss"].update(loss or {})
        safetensors.torch.save_file(safetensors.torch.load_file(str(path)), str(dest / path.name),
                                    metadata={"edm2": json.dumps(metadata)})
    return dest


def sweep_loss(indir, train_data, dest):
    return CliRunner().invoke(calculate_metrics.main, [
        "sweep", f"--indir={indir}", "--std=0.1", "--kimg=2", "--metrics=loss", f"--data={train_data}", "--num=8",
        "--batch=8", f"--dest={dest}"])


def test_a_snapshot_without_the_loss_names_means_edm2s(reference_run, train_data, tmp_path):
    old = copy_with_loss(reference_run, tmp_path / "old", None)
    for indir, dest in ((reference_run, tmp_path / "new-out"), (old, tmp_path / "old-out")):
        assert sweep_loss(indir, train_data, dest).exit_code == 0
    rows = [json.loads((tmp_path / f"{k}-out" / "ema-sweep.json").read_text())["rows"] for k in ("new", "old")]
    assert rows[0][0]["loss"] == rows[1][0]["loss"]


@pytest.mark.bad_input
@pytest.mark.parametrize("loss, fragments", [
    ({"weighting": "lpips"}, ("loss weighting 'lpips' is not registered", "edm2")),
    ({"uncertainty": "sometimes"}, ("uncertainty 'sometimes' is not registered", "learned, off"))])
def test_a_snapshot_naming_an_unregistered_loss_is_refused_in_one_line(reference_run, train_data, tmp_path, loss,
                                                                       fragments):
    run = copy_with_loss(reference_run, tmp_path / "run", loss)
    assert_refused(tmp_path, lambda: sweep_loss(run, train_data, tmp_path / "out"), "--indir", *fragments)


@pytest.mark.bad_input
@pytest.mark.parametrize("option, value", [("--loss-weighting", "lpips"), ("--noise-dist", "uniform"),
                                           ("--uncertainty", "sometimes")])
def test_an_unknown_loss_name_is_refused_in_one_line(train_data, tmp_path, option, value):
    assert_refused(tmp_path, lambda: CliRunner().invoke(train_edm2.main, [
        *TRAIN_ARGS, f"--data={train_data}", f"--outdir={tmp_path / 'run'}", f"{option}={value}"]), option, value)


@pytest.mark.parametrize("field, option", [("loss_weighting", "--loss-weighting"), ("noise_dist", "--noise-dist")])
def test_options_built_in_python_refuse_an_unknown_loss_name(field, option):
    with pytest.raises(OptionsError, match=f"^{option}='nope': expected one of "):
        toy_tiny_options(**{field: "nope"})


def test_a_resumed_run_keeps_its_loss_and_runs_from_before_the_names_had_edm2s():
    run = toy_tiny_options().hyperparameters()
    del run["loss_weighting"], run["noise_dist"]
    check_same_hyperparameters(run, toy_tiny_options().hyperparameters())
    with pytest.raises(OptionsMismatch, match="loss_weighting: run has 'edm2', now 'min-snr'"):
        check_same_hyperparameters(run, {**toy_tiny_options().hyperparameters(), "loss_weighting": "min-snr"})


def test_the_loss_per_noise_level_weights_by_the_loss_it_is_given(monkeypatch):
    # The dashboard's curve (loss_per_sigma): the same errors, each weighted by the run's lambda(sigma).
    name, extended = apply_example(loss_module, "A loss weighting", "WEIGHTINGS", monkeypatch)
    net = tiny_precond().eval()
    generator = torch.Generator().manual_seed(0)
    y, noise = torch.randn([2, 2, 3, 8, 8], generator=generator)
    sigmas = [0.01, 0.3, 5.0]
    edm2, _ = loss_per_sigma(net, y, noise, None, sigmas, loss_module.EDM2Loss(sigma_data=0.5))
    ours, _ = loss_per_sigma(net, y, noise, None, sigmas, loss_module.EDM2Loss(sigma_data=0.5, weighting=name))
    for sigma, a, b in zip(sigmas, edm2, ours):
        sigma = torch.tensor(sigma, dtype=torch.float64)
        ratio = extended.min_snr_weight(sigma, 0.5) / loss_module.edm2_weight(sigma, 0.5)
        assert b == pytest.approx(a * float(ratio), rel=1e-12)
    assert ours[0] < 0.5 * edm2[0]  # the cap bites at low noise
