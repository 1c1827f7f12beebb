"""reconstruct_phema.py: post-hoc EMA from a run's snapshots, end to end, and its answers to bad input."""

import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

import reconstruct_phema
from edm2 import phema
from edm2.networks import Precond
from edm2.sampler import edm_sampler
from edm2.snapshot import load_network, save_network
from tests.helpers import REPO, forget_release_standins, random_release_tiny_net, tiny_precond, write_release_pickle


def tiny_net(model_channels=16) -> Precond:
    return tiny_precond(model_channels=model_channels)


def fake_training_run(run_dir: Path, num_snapshots=6, steps_per_snapshot=4, batch_size=256) -> None:
    """Random-walk 'training' of a tiny net whose two EMA tracks are saved as our snapshot files."""
    torch.manual_seed(0)
    net = tiny_net()
    ema = phema.PowerFunctionEMA(net)
    nimg = 0
    for _ in range(num_snapshots):
        for _ in range(steps_per_snapshot):
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(torch.randn_like(p), alpha=0.05)
            nimg += batch_size
            ema.update(cur_nimg=nimg, batch_size=batch_size)
        for track, std in ema.get():
            path = run_dir / f"network-snapshot-{nimg // 1000:07d}-{std:.3f}.safetensors"
            save_network(path, track, {"nimg": nimg, "ema_std": std, "preset": "tiny"})


def run_cli(*args):
    return CliRunner().invoke(reconstruct_phema.main, list(args))


def test_reconstruction_from_our_run_loads_and_samples(tmp_path, monkeypatch):
    # Issue 4, Must show 3, with the documented defaults: newest run under training-runs/, into its phema/.
    older, run = tmp_path / "training-runs" / "older", tmp_path / "training-runs" / "tiny"
    older.mkdir(parents=True)
    run.mkdir()
    fake_training_run(run)
    monkeypatch.chdir(tmp_path)
    result = run_cli("--std=0.03,0.10", "--batch=1")
    assert result.exit_code == 0, result.output
    out_dir = run / "phema"
    assert sorted(p.name for p in out_dir.iterdir()) == ["phema-0000006-0.030.safetensors",
                                                          "phema-0000006-0.100.safetensors"]

    net, meta = load_network(out_dir / "phema-0000006-0.030.safetensors")
    assert meta["nimg"] == 6144 and meta["ema_std"] == 0.03 and meta["preset"] == "tiny"
    used = meta["phema"]["inputs"]
    assert len(used) == 12 and sum(u["coef"] for u in used) == pytest.approx(1.0)
    assert meta["phema"]["profile_error"] < 0.05
    # The weights are the stated combination of the (float16) inputs, computed here in float64.
    want = {}
    for u in used:
        for name, t in safetensors.torch.load_file(str(run / u["file"])).items():
            want[name] = want.get(name, 0) + u["coef"] * t.double()
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.double(), want[name], rtol=2e-3, atol=2e-3)
    assert not torch.equal(net.unet.out_gain, torch.zeros_like(net.unet.out_gain))

    # Must show 2 through the tool: 0.10 at the newest snapshot is the stored 0.100 track.
    rec, _ = load_network(out_dir / "phema-0000006-0.100.safetensors")
    stored, _ = load_network(run / "network-snapshot-0000006-0.100.safetensors")
    for (name, a), b in zip(rec.state_dict().items(), stored.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-4, msg=name)

    noise = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    labels = torch.eye(10)[:2]
    with torch.no_grad():
        images = edm_sampler(net, noise, labels, num_steps=2)
        assert images.shape == (2, 3, 8, 8) and torch.isfinite(images).all()
        assert not torch.allclose(net(noise, 1.0, labels), rec(noise, 1.0, labels))

    # --skip leaves existing outputs alone; --kimg picks an earlier time; --instd/--inprefix filter.
    before = (out_dir / "phema-0000006-0.030.safetensors").stat().st_mtime_ns
    assert run_cli("--std=0.03", "--skip").output.strip().endswith("nothing to do.")
    assert (out_dir / "phema-0000006-0.030.safetensors").stat().st_mtime_ns == before
    result = run_cli(f"--indir={run}", f"--outdir={tmp_path / 'early'}", "--kimg=3", "--std=0.2",
                     "--instd=0.05", "--inprefix=network-snapshot", "--prefix=x")
    assert result.exit_code == 0, result.output
    _, meta = load_network(tmp_path / "early" / "x-0000003-0.200.safetensors")
    assert meta["nimg"] == 3072 and [u["nimg"] for u in meta["phema"]["inputs"]] == [1024, 2048, 3072]
    assert {u["ema_std"] for u in meta["phema"]["inputs"]} == {0.05}


def test_release_pickles_as_inputs(tmp_path, release_standins):
    # Raw snapshots in the release's format, read through edm2.snapshot.load_network's safe importer;
    # the image count comes from the file name's kimg (the release's naming: kimg = images // 1000 of 1024-image batches).
    names = []
    for seed, (kimg, std) in enumerate([(134217, 0.05), (134217, 0.10), (268435, 0.05), (268435, 0.10)]):
        names.append(f"edm2-img512-xs-{kimg:07d}-{std:.3f}.pkl")
        write_release_pickle(tmp_path / names[-1], random_release_tiny_net(seed), *release_standins)
    forget_release_standins()
    result = run_cli(f"--indir={tmp_path}", "--std=0.07")
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "ran").exists()
    net, meta = load_network(tmp_path / "phema" / "phema-0268435-0.070.safetensors")
    assert meta["nimg"] == 2**28 and meta["source"] == "release-pickle" and meta["loss"]["P_mean"] == -0.4
    used = meta["phema"]["inputs"]
    assert [u["file"] for u in used] == names and [u["nimg"] for u in used] == [2**27, 2**27, 2**28, 2**28]
    want = sum(u["coef"] * load_network(tmp_path / u["file"])[0].unet.out_gain.double() for u in used)
    torch.testing.assert_close(net.unet.out_gain.double(), want, rtol=2e-3, atol=2e-3)

    # A later snapshot of another network is caught while streaming, before anything is written.
    save_network(tmp_path / "network-snapshot-0300000-0.100.safetensors", tiny_net(), {"nimg": 300000 * 1024,
                                                                                       "ema_std": 0.1})
    result = run_cli(f"--indir={tmp_path}", f"--outdir={tmp_path / 'bad'}", "--std=0.07")
    assert result.exit_code == 1 and "architecture differs" in result.output, result.output
    assert not (tmp_path / "bad").exists()


def test_std_lists_and_ranges():
    parse = reconstruct_phema.StdList().convert
    assert parse("0.1", None, None) == [0.1]
    assert parse("0.15,0.05,0.15", None, None) == [0.05, 0.15]
    expanded = parse("0.010,0.015,...,0.250", None, None)
    assert len(expanded) == 49 and expanded[:3] == [0.01, 0.015, 0.02] and expanded[-1] == 0.25
    assert parse("0.01,0.02,...,0.05,0.2", None, None) == [0.01, 0.02, 0.03, 0.04, 0.05, 0.2]
    assert reconstruct_phema.kimg_to_nimg(2147483) == 2**31
    assert reconstruct_phema.kimg_to_nimg(1) == 1024 and reconstruct_phema.kimg_to_nimg(42) is None


@pytest.mark.parametrize("args, message", [
    (["--std=0"], "outside (0, 0.2887)"),
    (["--std=0.05,0.2887"], "outside (0, 0.2887)"),
    (["--std=-0.1"], "outside (0, 0.2887)"),
    (["--std=0.01,0.02,...,0.055"], "not an evenly spaced range"),
    (["--std=0.01,...,0.05"], "needs two numbers before it"),
    (["--std=0.1,abc"], "not a comma-separated list"),
    (["--std=0.0501,0.0504"], "share the file name suffix 0.050"),
    (["--std=0.1", "--kimg=7"], "no snapshot at kimg 7"),
    (["--std=0.1", "--indir=empty"], "holds no matching snapshot files"),
    (["--std=0.1", "--indir=missing"], "is not a directory"),
    (["--std=0.1", "--indir=mixed"], "network architecture differs"),
    (["--std=0.1", "--indir=corrupt"], "not a readable release pickle"),
])
def test_bad_input_is_one_clear_error_and_writes_nothing(tmp_path, monkeypatch, args, message):
    # Issue 4, Must show 4.
    run = tmp_path / "training-runs" / "tiny"
    run.mkdir(parents=True)
    fake_training_run(run, num_snapshots=2, steps_per_snapshot=1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "mixed").mkdir()
    fake_training_run(tmp_path / "mixed", num_snapshots=2, steps_per_snapshot=1)
    save_network(tmp_path / "mixed" / "network-snapshot-0000001-0.070.safetensors", tiny_net(model_channels=32),
                 {"nimg": 1024, "ema_std": 0.07})
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "edm2-img512-xs-0134217-0.050.pkl").write_bytes(b"truncated")
    files_before = sorted(tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)
    result = run_cli(*args)
    assert result.exit_code in (1, 2) and isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and message in errors[0], result.output
    assert sorted(tmp_path.rglob("*")) == files_before


def test_command_line_errors_without_traceback(tmp_path):
    result = subprocess.run([sys.executable, "reconstruct_phema.py", "--std=0.1", f"--indir={tmp_path / 'nope'}"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"Error: Invalid value for '--indir': {tmp_path / 'nope'} is not a directory"
    assert "--std=0.010,0.015,...,0.250" in run_cli("--help").output
    assert not (tmp_path / "nope").exists()
