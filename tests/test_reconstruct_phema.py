"""reconstruct_phema.py: post-hoc EMA from a run's snapshots, end to end, and its answers to bad input."""

import os
import shutil
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

import reconstruct_phema
from cli.types import StdList
from edm2 import phema
from edm2.formats.snapshot import load_network, save_network
from edm2.procedures import posthoc
from edm2.runtime import files
from edm2.runtime.locks import FOLDER_LOCK, hold_destination
from edm2.sampler import edm_sampler
from tests.helpers import (FAKE_RUN, REPO, assert_one_error_line, assert_refused, fake_training_run, forget_release_standins,
                           random_release_tiny_net, tiny_precond, write_release_pickle)


def run_cli(*args):
    return CliRunner().invoke(reconstruct_phema.main, list(args))


def combination_bound(weights: list[torch.Tensor], coefs: list[float]) -> torch.Tensor:
    """Largest error of a float16 file holding the float32 sum_i c_i w_i, against that sum in float64.

    Summing n products in float32 errs by at most (n + 2) 2^-24 sum_i |c_i w_i| (the product, the sum and
    the coefficient's own rounding to float32); rounding the result to float16 adds 2^-11 of it, or at most
    2^-25 where it is subnormal.
    """
    magnitude = sum(abs(c) * w.abs() for c, w in zip(coefs, weights))
    exact = sum(c * w for c, w in zip(coefs, weights))
    float32_error = (len(weights) + 2) * 2**-24 * magnitude
    return float32_error + 2**-11 * (exact.abs() + float32_error) + 2**-25


def assert_is_combination(net, used, folder: Path, target: np.ndarray | None = None) -> None:
    """net's parameters are the recorded combination of the (float16) input files, computed in float64.

    With target coefficients, they are also target's combination, up to the distance sum_i |c_i - t_i| |w_i|.
    """
    inputs = [safetensors.torch.load_file(str(folder / u["file"])) for u in used]
    coefs = [u["coef"] for u in used]
    target = np.array(coefs) if target is None else target
    for name, p in net.named_parameters():
        weights = [state[name].double() for state in inputs]
        want = sum(t * w for t, w in zip(target, weights))
        distance = sum(abs(c - t) * w.abs() for c, t, w in zip(coefs, target, weights))
        assert ((p.double() - want).abs() <= combination_bound(weights, coefs) + distance).all(), name


def gram_condition(nimg: list[int], stds: list[float]) -> float:
    """Condition number of the matrix A of Eq. 142 for these inputs."""
    nimg, stds = np.float64(nimg), np.float64(stds)
    return float(np.linalg.cond(phema.power_function_inner(nimg[:, None], stds[:, None], nimg[None, :], stds[None, :])))


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
    # Normalized in float64 (Algorithm 3): the sum is 1 within 12 * 2^-53 * sum|c|, far inside approx's 1e-6.
    assert len(used) == 12 and sum(u["coef"] for u in used) == pytest.approx(1.0)
    assert meta["phema"]["profile_error"] < 0.05
    assert_is_combination(net, used, run)
    assert not torch.equal(net.unet.out_gain, torch.zeros_like(net.unet.out_gain))

    # Must show 2 through the tool: 0.10 at the newest snapshot is the stored 0.100 track, up to the
    # float16 rounding and the solve's distance from the unit vector (n * cond(A) * 2^-53, Eq. 142).
    rec, rec_meta = load_network(out_dir / "phema-0000006-0.100.safetensors")
    rec_used = rec_meta["phema"]["inputs"]
    assert rec_used[-1]["file"] == "network-snapshot-0000006-0.100.safetensors"
    coefs, unit = np.array([u["coef"] for u in rec_used]), np.eye(len(rec_used))[-1]
    cond = gram_condition([u["nimg"] for u in rec_used], [u["ema_std"] for u in rec_used])
    np.testing.assert_allclose(coefs, unit, rtol=0, atol=len(coefs) * cond * 2**-53)
    assert_is_combination(rec, rec_used, run, target=unit)  # the stored track itself, as loaded from its file

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
    # A rerun replaces its own earlier outputs (post-hoc reconstructions), nothing else.
    assert run_cli(f"--indir={run}", f"--outdir={tmp_path / 'early'}", "--kimg=3", "--std=0.2", "--prefix=x").exit_code == 0


def test_release_pickles_as_inputs(tmp_path, release_standins):
    # Raw snapshots in the release's format, read through edm2.formats.snapshot.load_network's safe importer;
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
    weights = [load_network(tmp_path / u["file"])[0].unet.out_gain.double() for u in used]
    coefs = [u["coef"] for u in used]
    want = sum(c * w for c, w in zip(coefs, weights))
    assert ((net.unet.out_gain.double() - want).abs() <= combination_bound(weights, coefs)).all()

    # A later snapshot of another network is caught while streaming, before anything is written.
    save_network(tmp_path / "network-snapshot-0300000-0.100.safetensors", tiny_precond(),
                 {"nimg": 300000 * 1024, "ema_std": 0.1})
    result = run_cli(f"--indir={tmp_path}", f"--outdir={tmp_path / 'bad'}", "--std=0.07")
    assert_one_error_line(result, "architecture differs")
    assert not (tmp_path / "bad").exists()


def test_std_lists_and_ranges():
    parse = StdList().convert
    assert parse("0.1", None, None) == [0.1]
    assert parse("0.15,0.05,0.15", None, None) == [0.05, 0.15]
    expanded = parse("0.010,0.015,...,0.250", None, None)
    assert len(expanded) == 49 and expanded[:3] == [0.01, 0.015, 0.02] and expanded[-1] == 0.25
    assert parse("0.01,0.02,...,0.05,0.2", None, None) == [0.01, 0.02, 0.03, 0.04, 0.05, 0.2]
    assert len(parse("0.001,0.002,...,0.288", None, None)) == 288


def write_mixed(folder: Path) -> None:
    fake_training_run(folder, num_snapshots=2)
    save_network(folder / "network-snapshot-0000001-0.070.safetensors", tiny_precond(model_channels=32),
                 dict(FAKE_RUN, nimg=1024, ema_std=0.07))


def write_copy(run: Path, name: str, metadata: dict | None = None) -> None:
    """A copy of the run's first track under another name, with other metadata when given."""
    net, meta = load_network(run / "network-snapshot-0000001-0.050.safetensors")
    save_network(run / name, net, meta if metadata is None else metadata)


def stamp(folder: Path, **changes) -> None:
    """Rewrite the metadata of every training snapshot in folder with changes (a run_id, another preset)."""
    for path in folder.glob("network-snapshot-*.safetensors"):
        net, meta = load_network(path)
        save_network(path, net, dict(meta, **changes))


def second_training(run: Path, first: dict, second: dict) -> None:
    """Snapshots of another training (at other times) added to run's folder; each run's metadata changed by
    `first` and `second`."""
    stamp(run, **first)
    other = fake_training_run(run.parent / "other", num_snapshots=2, batch_size=384)
    stamp(other, **second)
    for path in other.iterdir():
        path.rename(run / path.name)
    other.rmdir()


# case -> (arguments, fragments of the one error line, preparation beyond the run in training-runs/tiny)
BAD_INPUT = {
    "std zero": (["--std=0"], ["outside (0, 0.2887)"], None),
    "std at the limit": (["--std=0.05,0.2887"], ["outside (0, 0.2887)"], None),
    "std negative": (["--std=-0.1"], ["outside (0, 0.2887)"], None),
    "std nan": (["--std=nan"], ["--std", "'nan' is not a finite number"], None),
    "std inf": (["--std=0.05,inf"], ["--std", "'inf' is not a finite number"], None),
    "instd nan": (["--std=0.1", "--instd=nan"], ["--instd", "'nan' is not a finite number"], None),
    "range to inf": (["--std=0.01,0.02,...,inf"], ["'inf' is not a finite number"], None),
    "range to nan": (["--std=0.01,0.02,...,nan"], ["'nan' is not a finite number"], None),
    # A step of exactly 2^-30: 2^27 values, which click used to materialize as one list.
    "range of millions": (["--std=0.125,0.125000000931322574615478515625,...,0.25"],
                          ["more than the 288 distinct sigma_rel"], None),
    "uneven range": (["--std=0.01,0.02,...,0.055"], ["not an evenly spaced range"], None),
    "range without start": (["--std=0.01,...,0.05"], ["needs two numbers before it"], None),
    "not a number": (["--std=0.1,abc"], ["not a comma-separated list"], None),
    "same file name": (["--std=0.0501,0.0504"], ["share the file name suffix 0.050"], None),
    "no such kimg": (["--std=0.1", "--kimg=7"], ["'--kimg'", "no snapshot at kimg 7"], None),
    "negative kimg": (["--std=0.1", "--kimg=-1"], ["--kimg"], None),
    "zero batch": (["--std=0.1", "--batch=0"], ["--batch"], None),
    "empty indir": (["--std=0.1", "--indir=empty"], ["'--indir'", "holds no matching snapshot files"],
                    lambda tmp: (tmp / "empty").mkdir()),
    "missing indir": (["--std=0.1", "--indir=missing"], ["'--indir'", "is not a directory"], None),
    "no run directory": (["--std=0.1"], ["no run directory under training-runs/"],
                         lambda tmp: shutil.rmtree(tmp / "training-runs")),
    "mixed networks": (["--std=0.1", "--indir=mixed"], ["network architecture differs"],
                       lambda tmp: write_mixed(tmp / "mixed")),
    "corrupt pickle": (["--std=0.1", "--indir=corrupt"], ["not a readable release pickle"],
                       lambda tmp: (tmp / "corrupt").mkdir() or (tmp / "corrupt" / "edm2-img512-xs-0134217-0.050.pkl")
                       .write_bytes(b"truncated")),
    "pickle kimg between batches": (["--std=0.1", "--indir=odd"], ["kimg 42 is not a whole number of 1024-image"],
                                    lambda tmp: (tmp / "odd").mkdir() or (tmp / "odd" / "edm2-s-0000042-0.050.pkl")
                                    .write_bytes(b"never read")),
    # Two trainings' EMA snapshots in one folder were averaged into one network.
    "two trainings in one folder": (["--std=0.1"], ["come from different training runs", f"run ids {'a' * 32} and "
                                                    f"{'b' * 32}"],
                                    lambda tmp: second_training(tmp / "training-runs" / "tiny", {"run_id": "a" * 32},
                                                                {"run_id": "b" * 32})),
    "two older trainings in one folder": (["--std=0.1"], ["come from different training runs", "settings differ"],
                                          lambda tmp: second_training(tmp / "training-runs" / "tiny", {},
                                                                      {"preset": "other"})),
    "run id not a string": (["--std=0.1"], ["network-snapshot-0000001-0.050.safetensors", "its run_id 5 is not a"],
                            lambda tmp: stamp(tmp / "training-runs" / "tiny", run_id=5)),
    "same track twice": (["--std=0.1"], ["hold the same track"],
                         lambda tmp: write_copy(tmp / "training-runs" / "tiny", "other-0000001-0.050.safetensors")),
    "no training snapshot": (["--std=0.1"], ["metadata lacks 'nimg' and 'ema_std'"],
                             lambda tmp: write_copy(tmp / "training-runs" / "tiny",
                                                    "network-snapshot-0000003-0.050.safetensors", {})),
    "track sigma_rel too large": (["--std=0.1"], ["sigma_rel 0.5 is outside (0, 0.2887)"],
                                  lambda tmp: write_copy(tmp / "training-runs" / "tiny", "x-0000003-0.500.safetensors",
                                                         {"nimg": 3072, "ema_std": 0.5})),
    "track sigma_rel nan": (["--std=0.1"], ["NaN is not a JSON number"],
                            lambda tmp: write_copy(tmp / "training-runs" / "tiny", "x-0000003-0.050.safetensors",
                                                   {"nimg": 3072, "ema_std": float("nan")})),
    "outdir is a file": (["--std=0.1", "--outdir=file"], ["file is a file, not a folder"],
                         lambda tmp: (tmp / "file").write_text("x")),
    "outdir under a file": (["--std=0.1", "--outdir=file/out"], ["lies under file, which is a file"],
                            lambda tmp: (tmp / "file").write_text("x")),
    "output replaces a training snapshot": (
        ["--std=0.1", "--indir=training-runs/tiny", "--outdir=training-runs/tiny", "--prefix=network-snapshot"],
        ["'--prefix'", "network-snapshot-0000002-0.100.safetensors exists and is not a post-hoc reconstruction"], None),
    "under torchrun": (["--std=0.1"], ["runs as one process"], lambda tmp: os.environ.update(WORLD_SIZE="2")),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_clear_error_and_writes_nothing(tmp_path, monkeypatch, case):
    # Issue 4, Must show 4; issue 15: before any network is loaded (only a corrupt input needs loading to be found).
    args, fragments, prepare = BAD_INPUT[case]
    monkeypatch.setenv("WORLD_SIZE", "1")  # restored after the test, also where a case changes it
    fake_training_run(tmp_path / "training-runs" / "tiny", num_snapshots=2)
    if prepare is not None:
        prepare(tmp_path)
    if case != "corrupt pickle":
        monkeypatch.setattr(posthoc, "load_network", lambda path: pytest.fail(f"loaded {path} for bad input"))
    monkeypatch.chdir(tmp_path)
    assert_refused(tmp_path, lambda: run_cli(*args), *fragments)


def test_command_line_errors_without_traceback(tmp_path):
    result = subprocess.run([sys.executable, "reconstruct_phema.py", "--std=0.1", f"--indir={tmp_path / 'nope'}"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"Error: Invalid value for '--indir': {tmp_path / 'nope'} is not a directory"
    assert "--std=0.010,0.015,...,0.250" in run_cli("--help").output
    assert not (tmp_path / "nope").exists()


def run_on_tmpfs(tmp_path: Path, mount_options: str, args: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the command line in a mount namespace where tmp_path/mnt is a fresh tmpfs; also return what the tmpfs
    holds afterwards (it vanishes with the namespace)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (f"mount -t tmpfs -o {mount_options} tmpfs {mnt} || exit 99; {sys.executable} reconstruct_phema.py "
              f"\"$@\"; code=$?; echo ==; ls -A {mnt}; exit $code")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *args], cwd=REPO, capture_output=True, text=True)
    if result.returncode == 99 or "unshare:" in result.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    result.stdout, left = result.stdout.split("==\n")
    return result, left.split()


@pytest.mark.bad_input
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare to mount a read-only folder")
def test_a_read_only_outdir_is_refused_before_loading(tmp_path):
    run = fake_training_run(tmp_path / "run", num_snapshots=2)
    result, left = run_on_tmpfs(tmp_path, "ro", [f"--indir={run}", f"--outdir={tmp_path / 'mnt' / 'out'}", "--std=0.1"])
    assert_one_error_line(result, "cannot write in", "Read-only file system")
    assert "Reconstructing" not in result.stderr and left == []


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare to mount a tiny tmpfs")
def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    run = fake_training_run(tmp_path / "run", num_snapshots=2)
    size = (run / "network-snapshot-0000002-0.100.safetensors").stat().st_size
    assert size > 64 * 1024  # the output cannot fit
    result, left = run_on_tmpfs(tmp_path, "size=64k", [f"--indir={run}", f"--outdir={tmp_path / 'mnt' / 'out'}",
                                                       "--std=0.1"])
    assert_one_error_line(result, "phema-0000002-0.100.safetensors: cannot write", "No space left on device")
    assert left == []  # no temporary, and the output folder this run created is gone again


def test_stale_temporaries_of_a_killed_run_are_removed(tmp_path):
    run, out = fake_training_run(tmp_path / "run", num_snapshots=2), tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # its process id now belongs to no process
    name = "phema-0000002-0.100.safetensors"
    stale = out / files.temporary_name(name, f".{name}.{dead.pid}@{socket.gethostname()}.")
    live = out / files.temporary_name("phema-0000002-0.050.safetensors")
    stale.write_bytes(b"half a network")
    live.write_bytes(b"a writer that is still running")
    result = run_cli(f"--indir={run}", f"--outdir={out}", "--std=0.1")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == sorted([live.name, "phema-0000002-0.100.safetensors"])


@pytest.mark.bad_input
def test_a_second_run_into_an_outdir_in_use_is_refused(tmp_path):
    run, out = fake_training_run(tmp_path / "run", num_snapshots=2), tmp_path / "out"
    with hold_destination(out, "reconstruct_phema.py", FOLDER_LOCK):  # a run still writing its outputs
        assert_refused(tmp_path, lambda: run_cli(f"--indir={run}", f"--outdir={out}", "--std=0.1"),
                       f"{out} is in use by the reconstruct_phema.py process {os.getpid()} on host")


def test_one_input_network_in_memory_at_a_time(tmp_path, monkeypatch):
    # Memory is one input plus --batch outputs: every input is released before the next one loads, also
    # across passes (the outputs of a pass are saved and dropped before the next pass starts).
    run = fake_training_run(tmp_path / "run", num_snapshots=3)
    loaded = []

    def load(path):
        alive = [ref for ref in loaded if ref() is not None]
        assert not alive, f"{len(alive)} earlier inputs still in memory when loading {path}"
        net, meta = load_network(path)
        loaded.append(weakref.ref(net))
        return net, meta

    monkeypatch.setattr(posthoc, "load_network", load)
    result = run_cli(f"--indir={run}", f"--outdir={tmp_path / 'out'}", "--std=0.03,0.05,0.07", "--batch=2")
    assert result.exit_code == 0, result.output
    assert len(loaded) == 2 * 6 and len(list((tmp_path / "out").iterdir())) == 3
