"""calculate_metrics.py sweep: the validation loss across EMA lengths equals an independent computation, the
in-memory reconstructions are reconstruct_phema.py's files bit for bit, an interrupted sweep resumes, bad input."""

import json
import math
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import PIL.Image
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

import calculate_metrics
from cli import sweep as cli_sweep
from edm2.encoders import StabilityVAEEncoder, StandardRGBEncoder
from edm2.eval.sweep import SweepError, SweepResults, best_warnings, run_sweep
from edm2.formats.snapshot import METADATA_KEY, load_network, read_metadata, save_network
from edm2.plots.sweep import sweep_figure
from edm2.procedures import generation, posthoc
from edm2.runtime.locks import FOLDER_LOCK, hold_destination
from edm2.sampler import edm_sampler
from tests.helpers import (REPO, TinyInceptionStandIn, assert_one_error_line, assert_refused, fake_training_run,
                           pin_detector_file, validation_loss_by_hand, write_image_dataset)

NUM = 24  # samples of the loss; one batch of them, as the reference below


def sweep(*args):
    return CliRunner().invoke(calculate_metrics.main, ["sweep", *args])


def test_sweep_loss_and_reconstructions_equal_independent_ones(reference_run, train_data, tmp_path):
    # Issue 11, Must show 1: the loss metric against an independent computation, the reconstruction against
    # reconstruct_phema.py's file; two training times give two curves, each with its best EMA length marked.
    result = sweep(f"--indir={reference_run}", "--std=0.05,0.13,0.2", "--kimg=1,2", "--metrics=loss",
                   f"--data={train_data}", f"--num={NUM}", f"--batch={NUM}", "--seed=5", f"--dest={tmp_path / 'out'}",
                   f"--save={tmp_path / 'saved'}")
    assert result.exit_code == 0, result.output
    stored = json.loads((tmp_path / "out" / "ema-sweep.json").read_text())
    rows = stored["rows"]
    assert [(row["kimg"], row["std"]) for row in rows] == [(k, s) for k in (1, 2) for s in (0.05, 0.13, 0.2)]
    # A length the run tracks (0.05) is that track itself at every snapshot time: no profile error (Eq. 134).
    assert all(row["profile_error"] < 1e-9 for row in rows if row["std"] == 0.05)
    with PIL.Image.open(tmp_path / "out" / "ema-sweep.png") as image:
        assert image.format == "PNG"
    best = json.loads(result.output.strip().splitlines()[-1])["best"]["loss"]
    for kimg in ("1", "2"):
        curve = [row for row in rows if row["kimg"] == int(kimg)]
        assert best[kimg] == min(curve, key=lambda row: row["loss"])["std"]
    ax = sweep_figure(rows, ["loss"]).axes[0]
    curves = [line.get_ydata().tolist() for line in ax.get_lines() if len(line.get_xdata()) > 1]
    assert curves == [[row["loss"] for row in rows if row["kimg"] == k] for k in (1, 2)]

    assert subprocess.run([sys.executable, "reconstruct_phema.py", f"--indir={reference_run}", "--std=0.13",
                           f"--outdir={tmp_path / 'phema'}"], cwd=REPO, capture_output=True).returncode == 0
    [reference_file] = (tmp_path / "phema").glob("phema-0000002-0.130.safetensors")
    ours = safetensors.torch.load_file(str(tmp_path / "saved" / reference_file.name))
    theirs = safetensors.torch.load_file(str(reference_file))
    assert ours.keys() == theirs.keys()
    assert all(ours[k].reshape(-1).view(torch.uint8).equal(theirs[k].reshape(-1).view(torch.uint8)) for k in ours)

    net, meta = load_network(reference_file)
    expected = validation_loss_by_hand(net, train_data, NUM, 5, meta["loss"]["P_mean"], meta["loss"]["P_std"])
    [row] = [row for row in rows if row["kimg"] == 2 and row["std"] == 0.13]
    # The same float32 network outputs on the same batch (the sweep measures the float16-rounded weights the file
    # holds); only the float64 sums of 24 x 192 terms differ in order: ~1e-13 relative.
    assert row["loss"] == pytest.approx(expected, rel=1e-10)
    assert 0.2 < expected < 5  # lambda(sigma) makes Eq. 14 about 1 for a weak denoiser


def with_label_dropout(run, dest, p):
    """A copy of a run's snapshots whose metadata says they were trained with label dropout p."""
    dest.mkdir()
    for path in run.glob("network-snapshot-*.safetensors"):
        metadata = read_metadata(path)
        metadata["training_options"]["label_dropout"] = p
        safetensors.torch.save_file(safetensors.torch.load_file(str(path)), str(dest / path.name),
                                    metadata={METADATA_KEY: json.dumps(metadata)})
    return dest


@pytest.mark.parametrize("guide", ["autoguidance", "self"])
def test_sweep_fid_with_guidance_is_gen_on_the_reconstruction(reference_run, train_data, tmp_path, monkeypatch, guide):
    # FID through the sweep equals `calculate_metrics.py gen` on reconstruct_phema.py's file for that length, with
    # the guidance options and the solver of gen (autoguidance by the run's early snapshot, or the network's own
    # unconditional prediction; DPM-Solver++(2M)): the same seeds, the same images.
    solvers = []

    def sampler_spy(*args, solver, **kwargs):
        solvers.append(solver)
        return edm_sampler(*args, solver=solver, **kwargs)

    monkeypatch.setattr(generation, "edm_sampler", sampler_spy)
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(TinyInceptionStandIn()), tmp_path / "inception.pt")
    pin_detector_file(monkeypatch, "fid", tmp_path / "inception.pt")
    inception, gnet = f"--inception={tmp_path / 'inception.pt'}", reference_run / "network-snapshot-0000001-0.050.safetensors"
    indir = reference_run
    if guide == "self":
        indir, gnet = with_label_dropout(reference_run, tmp_path / "run", 0.1), "self"
    assert calculate_metrics.main.main(["ref", f"--data={train_data}", f"--dest={tmp_path / 'ref.npz'}", "--metrics=fid",
                                        inception], standalone_mode=False) is None
    common = ["--metrics=fid", f"--ref={tmp_path / 'ref.npz'}", inception, "--num=4", "--batch=4", "--seed=7",
              f"--gnet={gnet}", "--guidance=2", "--guidance-interval=0.3,5", "--solver=dpm2m"]
    result = sweep(f"--indir={indir}", "--std=0.13", f"--dest={tmp_path}", f"--save={tmp_path / 'saved'}",
                   *common)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "ema-sweep.json").read_text())
    [row] = results["rows"]
    assert results["settings"]["solver"] == "dpm2m" and solvers == ["dpm2m"]  # one batch of 4
    result = CliRunner().invoke(calculate_metrics.main, ["gen", f"--net={tmp_path / 'saved' / 'phema-0000002-0.130.safetensors'}",
                                                         *common])
    assert result.exit_code == 0, result.output
    assert row["fid"] == json.loads(result.output.strip().splitlines()[-1])["results"]["fid"]  # bit for bit
    assert solvers == ["dpm2m", "dpm2m"]


def test_an_interrupted_sweep_resumes_without_remeasuring(reference_run, tmp_path):
    # Issue 11, Must show 1: rows already measured are kept and never recomputed.
    snapshots = posthoc.list_snapshots(reference_run)
    times = [posthoc.select_inputs(snapshots, kimg) for kimg in (1, 2)]
    stds = [0.05, 0.08, 0.11]
    calls = []

    def measure(net):
        if len(calls) == 4:
            raise KeyboardInterrupt  # Ctrl-C during the fifth network
        calls.append(next(net.parameters()).sum().item())
        return {"loss": float(len(calls))}

    path, settings = tmp_path / "ema-sweep.json", {"metrics": ["loss"]}
    with pytest.raises(KeyboardInterrupt):
        run_sweep(times, stds, measure, SweepResults(path, settings), batch=2)
    first = json.loads(path.read_text())["rows"]
    assert [(row["nimg"], row["std"], row["loss"]) for row in first] == [
        (1024, 0.05, 1.0), (1024, 0.08, 2.0), (1024, 0.11, 3.0), (2048, 0.05, 4.0)]
    assert [p.name for p in tmp_path.iterdir()] == ["ema-sweep.json"]  # no temporary left by the interruption

    calls.clear()
    run_sweep(times, stds, lambda net: calls.append(1) or {"loss": 10.0 + len(calls)}, SweepResults(path, settings),
              batch=2)
    assert len(calls) == 2  # only the two missing rows were built and measured
    rows = json.loads(path.read_text())["rows"]
    assert rows[:4] == first and [(row["nimg"], row["std"], row["loss"]) for row in rows[4:]] == [
        (2048, 0.08, 11.0), (2048, 0.11, 12.0)]
    run_sweep(times, stds, lambda net: pytest.fail("measured again"), SweepResults(path, settings))


def other_sweep(tmp_path, reference_run):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ema-sweep.json").write_text(json.dumps({"settings": {"metrics": ["fid"]}, "rows": []}))


def unlabeled_data(tmp_path, _):
    write_image_dataset(tmp_path / "unlabeled", num=4, labels=False)


def encoderless_run(tmp_path, _):
    fake_training_run(tmp_path / "fake", num_snapshots=1, label_dim=4)


def replace_with_snapshot(tmp_path, run):
    (tmp_path / "saved").mkdir()
    shutil.copy(run / "network-snapshot-0000002-0.050.safetensors", tmp_path / "saved" / "phema-0000002-0.100.safetensors")


# case: ({option: value, None to leave it out}, fragments of the error line, what to prepare in tmp_path)
BAD_INPUT = {
    "missing indir": ({"--indir": "missing"}, ["--indir", "is not a directory"], None),
    "indir without snapshots": ({"--indir": "out"}, ["--indir", "no matching snapshot files"],
                                lambda tmp, run: (tmp / "out").mkdir()),
    "snapshots without an encoder": ({"--indir": "fake"}, ["--indir", "not an encoder config"], encoderless_run),
    "no such kimg": ({"--kimg": "7"}, ["--kimg", "no snapshot at kimg 7"], None),
    "kimg not numbers": ({"--kimg": "1,x"}, ["--kimg", "not a comma-separated list"], None),
    "kimg negative": ({"--kimg": "-1"}, ["--kimg", "every number must lie in [0, "], None),
    "std too large": ({"--std": "0.3"}, ["--std", "outside (0, 0.2887)"], None),
    "unknown metric": ({"--metrics": "loss,fd_clip"}, ["--metrics", "unknown metric 'fd_clip'", "loss"], None),
    "loss without data": ({"--data": None}, ["--data", "--metrics=loss needs the dataset"], None),
    "fid without ref": ({"--metrics": "fid,loss"}, ["--ref", "--metrics=fid needs reference statistics"], None),
    "guidance without gnet": ({"--guidance": "2"}, ["--gnet", "--guidance=2 needs a guiding network"], None),
    "guidance interval without guidance": ({"--guidance-interval": "0.3,5"}, ["--guidance-interval", "only with guidance"],
                                           None),
    "guidance interval reversed": ({"--guidance-interval": "5,0.3"}, ["--guidance-interval", "SIGMA_LO < SIGMA_HI"], None),
    "self-guidance without label dropout": ({"--gnet": "self", "--guidance": "2"},
                                            ["--gnet", "trained with label dropout"], None),
    "unknown solver": ({"--solver": "rk4"}, ["--solver", "'rk4'", "'dpm2m'"], None),
    "seeds past 2**32": ({"--seed": str(2**32 - 2)}, ["--seed", "go past"], None),
    "data of another resolution": ({"--data": "big"}, ["--data", "takes 3 channels at 8x8"],
                                   lambda tmp, run: write_image_dataset(tmp / "big", num=2, resolution=16)),
    "data without labels": ({"--data": "unlabeled"}, ["--data", "has no labels"], unlabeled_data),
    "dest is a file": ({"--dest": "file"}, ["--dest", "is a file, not a folder"],
                       lambda tmp, run: (tmp / "file").write_text("x")),
    "dest holds another sweep": ({"--dest": "out"}, ["--dest", "other settings (data, guidance, indir, metrics"],
                                 other_sweep),
    "dest holds a foreign file": ({"--dest": "out"}, ["--dest", "not a sweep's results file"],
                                  lambda tmp, run: (tmp / "out").mkdir() or (tmp / "out" / "ema-sweep.json").write_text("[")),
    "save is a file": ({"--save": "file"}, ["--save", "is a file, not a folder"],
                       lambda tmp, run: (tmp / "file").write_text("x")),
    "save would replace a snapshot": ({"--save": "saved"}, ["--save", "exists and is not a post-hoc reconstruction"],
                                      replace_with_snapshot),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("case", BAD_INPUT)
def test_sweep_bad_input_is_one_line_before_any_network_is_loaded(reference_run, train_data, tmp_path,
                                                                  monkeypatch, case):
    overrides, fragments, prepare = BAD_INPUT[case]
    if prepare is not None:
        prepare(tmp_path, reference_run)
    monkeypatch.setattr(posthoc, "load_network", lambda path: pytest.fail(f"loaded {path} for bad input"))
    monkeypatch.chdir(tmp_path)
    options = {"--indir": str(reference_run), "--std": "0.1", "--metrics": "loss", "--data": str(train_data),
               "--dest": "dest", "--num": "4", **overrides}
    assert_refused([tmp_path, reference_run], lambda: sweep(*[f"{k}={v}" for k, v in options.items() if v is not None]),
                   *fragments)


@pytest.mark.bad_input
@pytest.mark.parametrize("held", ["results file", "save folder"])
def test_a_second_sweep_into_outputs_in_use_is_refused_before_any_network_is_loaded(reference_run, train_data,
                                                                                   tmp_path, monkeypatch, held):
    # Two sweeps into one --dest each rewrote ema-sweep.json with its own rows, losing the other's.
    dest, saved = tmp_path / "dest", tmp_path / "saved"
    what = "calculate_metrics.py sweep"
    lock = (hold_destination(dest / "ema-sweep.json", what) if held == "results file"
            else hold_destination(saved, "reconstruct_phema.py", FOLDER_LOCK))
    monkeypatch.setattr(posthoc, "load_network", lambda path: pytest.fail(f"loaded {path} though refused"))
    with lock:
        assert_refused([tmp_path, reference_run], lambda: sweep(
            "--std=0.1", "--metrics=loss", f"--data={train_data}", "--num=4", f"--indir={reference_run}",
            f"--dest={dest}", f"--save={saved}"),
            f"{dest / 'ema-sweep.json' if held == 'results file' else saved} is in use by the "
            f"{what if held == 'results file' else 'reconstruct_phema.py'} process {os.getpid()} on host")


def test_a_sweep_grows_by_the_rows_it_lacks_and_a_finished_one_loads_no_network(reference_run, train_data, tmp_path,
                                                                                  monkeypatch):
    common = ["--metrics=loss", f"--data={train_data}", "--num=4", f"--indir={reference_run}", f"--dest={tmp_path}"]
    assert sweep("--std=0.1", *common).exit_code == 0
    first = json.loads((tmp_path / "ema-sweep.json").read_text())["rows"]
    result = sweep("--std=0.1,0.12", *common)  # one more EMA length: only that one is measured
    assert result.exit_code == 0 and "kimg 2 sigma_rel 0.120" in result.output
    assert "kimg 2 sigma_rel 0.100" not in result.output
    rows = json.loads((tmp_path / "ema-sweep.json").read_text())["rows"]
    assert rows[0] == first[0] and [row["std"] for row in rows] == [0.1, 0.12]
    (tmp_path / "ema-sweep.png").unlink()
    monkeypatch.setattr(posthoc, "load_network", lambda path: pytest.fail(f"loaded {path} again"))
    result = sweep("--std=0.12,0.1", *common)
    assert result.exit_code == 0 and "kimg 2 sigma_rel" not in result.output, result.output
    assert (tmp_path / "ema-sweep.png").is_file()  # drawn again from the rows alone
    assert math.isfinite(json.loads((tmp_path / "ema-sweep.json").read_text())["rows"][1]["loss"])


@pytest.mark.bad_input
def test_a_latent_run_whose_vae_cannot_load_is_refused_before_any_image_is_generated(train_data, tmp_path,
                                                                                    monkeypatch):
    # Our own latent-space run whose VAE is not there (offline): one line before the first length is measured.
    run = fake_training_run(tmp_path / "latent", num_snapshots=1, img_channels=4, label_dim=4)
    for path in run.iterdir():
        net, meta = load_network(path)
        save_network(path, net, dict(meta, encoder=StabilityVAEEncoder(str(tmp_path / "no-vae")).config()))
    torch.jit.save(torch.jit.script(TinyInceptionStandIn()), tmp_path / "inception.pt")
    pin_detector_file(monkeypatch, "fid", tmp_path / "inception.pt")
    inception = f"--inception={tmp_path / 'inception.pt'}"
    assert calculate_metrics.main.main(["ref", f"--data={train_data}", f"--dest={tmp_path / 'ref.npz'}", "--metrics=fid",
                                        inception], standalone_mode=False) is None
    monkeypatch.setattr(calculate_metrics, "run_sweep", lambda *args, **kwargs: pytest.fail("measured"))
    assert_refused(tmp_path, lambda: sweep(f"--indir={run}", "--std=0.1", "--metrics=fid", f"--ref={tmp_path / 'ref.npz'}",
                                           inception, "--num=4", f"--dest={tmp_path / 'out'}"),
                   "--indir", "cannot load the VAE", "no-vae")


@pytest.mark.bad_input
def test_a_results_file_nested_too_deep_is_one_line(tmp_path):
    path = tmp_path / "ema-sweep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SweepError, match="is not a sweep's results file .*nested 100000 levels") as info:
        SweepResults(path, {})
    assert "\n" not in str(info.value)


def sweepable_run(folder, **overrides):
    """fake_training_run's snapshots (8x8, 4 classes) with the encoder and noise distribution a sweep reads."""
    encoder = overrides.pop("encoder", None)
    run = fake_training_run(folder, num_snapshots=2, label_dim=4, **overrides)
    for path in run.iterdir():
        net, meta = load_network(path)
        save_network(path, net, dict(meta, encoder=encoder or StandardRGBEncoder().config(),
                                     loss={"P_mean": -0.8, "P_std": 1.6}))
    return run


def test_a_sweep_over_a_non_finite_snapshot_names_it_and_gives_no_best(train_data, tmp_path):
    run = sweepable_run(tmp_path / "run")
    poisoned = sorted(run.glob("network-snapshot-*-0.100.safetensors"))[-1]
    net, meta = load_network(poisoned)
    with torch.no_grad():
        next(net.parameters()).view(-1)[0] = math.inf
    save_network(poisoned, net, meta)
    result = sweep(f"--indir={run}", "--std=0.05,0.1", "--metrics=loss", f"--data={train_data}", "--num=4",
                   "--batch=4", f"--dest={tmp_path / 'out'}")
    line = assert_one_error_line(result, str(poisoned), "NaN or infinite")
    assert "best" not in result.output.replace(line, "")


@pytest.mark.bad_input
def test_a_sweep_over_data_holding_a_nan_names_the_file(tmp_path):
    run = sweepable_run(tmp_path / "run", img_channels=4, encoder=StabilityVAEEncoder(str(tmp_path / "no-vae")).config())
    data = tmp_path / "latents"
    (data / "00000").mkdir(parents=True)
    for i in range(4):
        latent = np.ones((8, 8, 8), np.float32)
        latent[0, 0, i] = math.nan if i == 2 else 0.0
        np.save(data / f"00000/img{i:08d}.npy", latent)
    (data / "dataset.json").write_text(json.dumps({"labels": [[f"00000/img{i:08d}.npy", i] for i in range(4)]}))
    result = sweep(f"--indir={run}", "--std=0.1", "--metrics=loss", f"--data={data}", "--num=4", "--batch=4",
                   f"--dest={tmp_path / 'out'}")
    assert_one_error_line(result, str(data), "img00000002.npy", "non-finite")
    assert "best" not in result.output


def test_a_non_finite_metric_stops_the_sweep_naming_its_snapshots(tmp_path):
    # Weights and data that are finite can still overflow in the network: that row would drop out of the ranking
    # silently (best_rows skips NaN), so the sweep stops naming the snapshots the reconstruction came from.
    run = fake_training_run(tmp_path / "run", num_snapshots=2, label_dim=4)
    times = [posthoc.select_inputs(posthoc.list_snapshots(run), kimg) for kimg in (1, 2)]
    values = iter([0.5, 0.25, math.nan])
    path = tmp_path / "ema-sweep.json"
    with pytest.raises(SweepError) as info:
        run_sweep(times, [0.05, 0.1], lambda net: {"loss": next(values)}, SweepResults(path, {"metrics": ["loss"]}))
    assert str(info.value) == (f"{run} (4 snapshots): the reconstruction of sigma_rel 0.050 at 2048 images has loss "
                               "nan, not a finite number; the sweep stops without a best length")
    assert [row["loss"] for row in json.loads(path.read_text())["rows"]] == [0.5, 0.25]


def sweep_rows(losses: dict[float, float], errors: dict[float, float], nimg: int = 2048) -> list[dict]:
    """Results rows of one training time: {sigma_rel: loss} with {sigma_rel: profile error}."""
    return [dict(kimg=nimg // 1000, nimg=nimg, std=std, loss=loss, profile_error=errors[std], seconds=0.0)
            for std, loss in losses.items()]


def test_the_summary_shows_profile_errors_and_flags_a_best_at_the_edge_or_poorly_reconstructed(tmp_path, capsys):
    # Issue 26, item 8: the best was an EMA length at the range's edge whose reconstruction was poor (0.44).
    stds = [0.01, 0.05, 0.1, 0.25]
    edge = sweep_rows(dict(zip(stds, [0.375, 0.40, 0.42, 0.45])), dict(zip(stds, [0.44, 2e-3, 1e-9, 0.08])))
    middle = sweep_rows(dict(zip(stds, [0.5, 0.30, 0.31, 0.45])), dict(zip(stds, [0.44, 2e-3, 1e-9, 0.08])), 4096)
    results = SweepResults(tmp_path / "ema-sweep.json", {"metrics": ["loss"]})
    results.rows = edge + middle
    cli_sweep.finish(SimpleNamespace(dest=tmp_path, results=results), ["loss"])  # as calculate_metrics sweep ends
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["kimg", "sigma_rel", "loss", "profile", "error"]
    for row, line in zip(edge + middle, lines[1:]):  # every length's profile error, with its verdict
        quality = {0.44: "poor", 2e-3: "fair", 1e-9: "good", 0.08: "poor"}[row["profile_error"]]
        assert line.split() == [str(row["kimg"]), f"{row['std']:.3f}", f"{row['loss']:.4f}",
                                f"{row['profile_error']:.1e}", quality]
    cautions = [line for line in lines if "caution" in line]
    assert len(cautions) == 2 and all("kimg 2: sigma_rel 0.010 is" in line for line in cautions)
    assert "the shortest length swept" in cautions[0] and "poorly reconstructed (profile error 4.4e-01" in cautions[1]
    summary = json.loads(lines[-1])
    assert summary["best"]["loss"] == {"2": 0.01, "4": 0.05}
    assert summary["warnings"]["loss"]["4"] == [] and len(summary["warnings"]["loss"]["2"]) == 2
    longest = sweep_rows(dict(zip(stds, [0.5, 0.4, 0.3, 0.2])), dict(zip(stds, [0, 0, 0, 0])))
    assert [w.split(":")[0] for w in best_warnings(longest, longest[-1])] == ["the longest length swept"]
