"""train_edm2.py end to end on a CPU: exact resume after SIGKILL/SIGTERM, damaged checkpoints, changed
hyperparameters, torchrun with two Gloo processes (also under SIGTERM), and bad input."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner
from torch.distributed.launcher.api import LaunchConfig

import train_edm2
from cli import local_launch
from edm2.formats.snapshot import load_network, read_metadata
from training.run import checkpoint
from training.run.run_dir import LOCK_FILE, RunLock
from edm2.runtime.distributed import free_port
from tests.helpers import (
    REPO, TRAIN_ARGS, assert_one_error_line, assert_refused, built_once, run_training, snapshot_contents,
    start_training, stopped_at, train_env, tree, wait_for, write_image_dataset,
)


def final_snapshots(outdir: Path) -> dict[str, tuple]:
    """The two final (2048-image) EMA snapshots, less the options that may change between invocations."""
    contents = snapshot_contents(outdir, "network-snapshot-0000002-*.safetensors")
    assert len(contents) == 2
    return contents


def run_ids(outdir: Path) -> set:
    """The run ids a run directory's snapshots, training states and training_options.json carry."""
    ids = {read_metadata(path).get("run_id") for path in outdir.glob("network-snapshot-*.safetensors")}
    ids |= {checkpoint.load_state(path).get("run_id") for path in outdir.glob("training-state-*.pt")}
    return ids | {json.loads((outdir / "training_options.json").read_text()).get("run_id")}


def cli(args: list[str], outdir: Path):
    """Run train_edm2.py in-process; return click's result."""
    return CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, "--workers=0", f"--outdir={outdir}", *args])


def test_run_directory_contents(reference_run):
    names = sorted(p.name for p in reference_run.iterdir())
    assert names == [
        "log.txt",
        "network-snapshot-0000001-0.050.safetensors", "network-snapshot-0000001-0.100.safetensors",
        "network-snapshot-0000002-0.050.safetensors", "network-snapshot-0000002-0.100.safetensors",
        "plots", "samples", "stats.jsonl", "training-state-0000001.pt", "training-state-0000002.pt", "training_options.json",
    ]
    rows = [json.loads(line) for line in (reference_run / "stats.jsonl").read_text().splitlines()]
    assert [r["nimg"] for r in rows] == [512, 1024, 1536, 2048]
    assert all(np.isfinite(r["loss"]) and r["images_per_s"] > 0 and r["max_memory_gb"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    # Eq. 67 before t_ref = 100 steps, after the 500-image ramp-up; the first row's last step was at 480.
    assert rows[0]["lr"] == pytest.approx(0.01 * 480 / 500) and rows[-1]["lr"] == pytest.approx(0.01)
    log = (reference_run / "log.txt").read_text()
    assert "computing in float32 on cpu" in log and sum(line.startswith("kimg ") for line in log.splitlines()) == 4

    net, meta = load_network(reference_run / "network-snapshot-0000002-0.100.safetensors")
    assert meta["nimg"] == 2048 and meta["ema_std"] == 0.1 and meta["preset"] == "toy-tiny"
    assert len(run_ids(reference_run)) == 1 and re.fullmatch("[0-9a-f]{32}", meta["run_id"])
    assert meta["encoder"] == {"class": "StandardRGBEncoder"}
    assert meta["dataset"] == {"resolution": 8, "num_channels": 3, "label_dim": 4}
    assert meta["training_options"]["lr"] == 0.01 and net.label_dim == 4
    state = checkpoint.load_state(reference_run / "training-state-0000002.pt")
    assert state["cur_nimg"] == 2048 and state["ema"]["stds"] == [0.05, 0.1]
    # Each snapshot holds its EMA track (in float16); the two tracks average differently.
    tracks = []
    for std, ema in zip(("0.050", "0.100"), state["ema"]["emas"]):
        saved = safetensors.torch.load_file(str(reference_run / f"network-snapshot-0000002-{std}.safetensors"))
        assert all(torch.equal(saved[k], v.to(saved[k].dtype)) for k, v in ema.items())
        tracks.append(ema["unet.out_conv.weight"])
    assert not torch.equal(tracks[0], tracks[1])
    assert not torch.equal(tracks[0], state["net"]["unet.out_conv.weight"])
    assert state["options_hash"] == checkpoint.options_hash(json.loads(state["options"]))


def test_sigkill_after_first_checkpoint_then_rerun_is_bit_identical(train_data, reference_run, tmp_path):
    outdir = tmp_path / "killed"
    proc = start_training(train_data, outdir, "--workers=1")
    wait_for(lambda: (outdir / "training-state-0000001.pt").exists(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    # Usually the kill lands before the next training state; on a busy machine it may land after it.
    newest = checkpoint.list_states(outdir)[0]
    nimg = checkpoint.load_state(newest)["cur_nimg"]

    result = run_training(train_data, outdir, "--workers=1")
    assert result.returncode == 0, result.stderr
    assert f"Resuming from {newest.name} at {nimg} images" in result.stdout
    assert final_snapshots(outdir) == final_snapshots(reference_run)
    rows = [json.loads(line)["nimg"] for line in (outdir / "stats.jsonl").read_text().splitlines()]
    assert rows == [512, 1024, 1536, 2048]  # rows the killed run wrote after its checkpoint are dropped


def test_sigterm_checkpoints_exits_zero_and_resumes_exactly(train_data, reference_run, tmp_path):
    outdir = tmp_path / "preempted"
    # A duration the signal cannot miss, however busy the machine; the rerun ends at the reference's 2048 images.
    proc = start_training(train_data, outdir, "--workers=1", "--duration=64Ki")
    wait_for(lambda: (outdir / "stats.jsonl").exists(), proc)  # the first status line (512 images)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "Received SIGTERM" in output
    assert not (outdir / LOCK_FILE).exists()  # released on the way out
    nimg = stopped_at(output)
    newest = checkpoint.list_states(outdir)[0]
    assert checkpoint.load_state(newest)["cur_nimg"] == nimg and nimg >= 512 and nimg % 32 == 0

    result = run_training(train_data, outdir, "--workers=0")
    assert result.returncode == 0, result.stderr
    assert f"Resuming from {newest.name} at {nimg} images" in result.stdout
    pattern, ignore = "network-snapshot-0000002-*.safetensors", ("run_dir", "workers", "duration")
    assert snapshot_contents(outdir, pattern, ignore) == snapshot_contents(reference_run, pattern, ignore)
    # One identity for the run across the stop and the resume; another run of the same command has its own.
    assert len(run_ids(outdir)) == 1 and run_ids(outdir) != run_ids(reference_run)


def test_damaged_newest_checkpoint_falls_back_and_changed_options_are_refused(train_data, reference_run, tmp_path):
    outdir = tmp_path / "damaged"
    shutil.copytree(reference_run, outdir)
    newest = outdir / "training-state-0000002.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    for snapshot in outdir.glob("network-snapshot-0000002-*"):
        snapshot.unlink()

    result = run_training(train_data, outdir, "--workers=0")
    assert result.returncode == 0, result.stderr
    assert "Skipping training state" in result.stdout and "training-state-0000002.pt: unreadable" in result.stdout
    assert "Resuming from training-state-0000001.pt at 1024 images" in result.stdout
    assert final_snapshots(outdir) == final_snapshots(reference_run)

    result = cli([f"--data={train_data}", "--lr=0.02", "--P_mean=-1.0", "--status=256"], outdir)
    assert assert_one_error_line(result) == (
        f"Error: {outdir}: cannot resume with different hyperparameters "
        "(P_mean: run has -0.8, now -1.0, lr: run has 0.01, now 0.02)"
    )
    result = cli([f"--data={train_data}", "--status=256"], outdir)  # intervals may change
    assert result.exit_code == 0 and "Training already complete" in result.output



# After a signal torchrun waits for its workers 30 s, then SIGKILLs them; where it has --shutdown-timeout (not
# PyTorch 2.11's), the tests give them as long as a busy machine may need.
SHUTDOWN_TIMEOUT = (["--shutdown-timeout=300"]
                    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else [])


def torchrun_command(data: Path, outdir: Path, *extra: str) -> list[str]:
    """torchrun with two Gloo processes of 2 rounds x 8 images: a 1024-image run."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
            *SHUTDOWN_TIMEOUT, "train_edm2.py", *TRAIN_ARGS, "--duration=1Ki", "--batch-gpu=8", f"--data={data}",
            f"--outdir={outdir}", *extra]


@pytest.fixture(scope="module")
def ddp_run(train_data, tmp_path_factory) -> tuple[Path, str]:
    """An uninterrupted 1024-image run of two Gloo processes (made once for the session), and its output."""
    folder, output = built_once(tmp_path_factory, "ddp-run",
                                lambda folder: run_torchrun(train_data, folder / "ddp").stdout)
    return folder / "ddp", output


def test_torchrun_two_gloo_processes(ddp_run):
    outdir, output = ddp_run
    assert "2 process(es) x 2 round(s) x 8 images" in output
    assert sorted(p.name for p in outdir.glob("network-snapshot-*")) == [
        "network-snapshot-0000001-0.050.safetensors", "network-snapshot-0000001-0.100.safetensors"
    ]
    state = checkpoint.load_state(outdir / "training-state-0000001.pt")
    assert state["cur_nimg"] == 1024
    # Each rank hashed its own weights when the checkpoint was written; both equal the saved weights.
    net = load_network(outdir / "network-snapshot-0000001-0.050.safetensors")[0]
    net.load_state_dict(state["net"])
    assert state["rank_digests"] == [checkpoint.weights_digest(net)] * 2
    ema = safetensors.torch.load_file(str(outdir / "network-snapshot-0000001-0.100.safetensors"))
    assert all(torch.isfinite(t.float()).all() for t in ema.values())


def stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command's name (state, parent, ...); OSError once the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_tree(root: int) -> list[int]:
    """root and every process below it, from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat_fields(stat.parent.name)[1])
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            continue
    tree_ = [root]
    for pid in tree_:
        tree_ += [child for child, parent in parents.items() if parent == pid]
    return tree_


@pytest.mark.parametrize("target", ["torchrun", "every process"])
def test_torchrun_sigterm_checkpoints_and_resumes_exactly(target, train_data, ddp_run, tmp_path):
    # "torchrun": a user or a scheduler signals the launcher, which forwards SIGTERM to each worker's process
    # group. "every process": SLURM-style preemption signals the launcher, the workers and their data loader
    # processes alike, so each worker gets SIGTERM twice (directly and forwarded); the second is ignored.
    outdir = tmp_path / "preempted"
    # A duration the signal cannot miss, however busy the machine; the rerun ends at ddp_run's 1024 images.
    proc = subprocess.Popen(torchrun_command(train_data, outdir, "--workers=1", "--status=256", "--duration=64Ki"),
                            cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: (outdir / "stats.jsonl").exists(), proc)  # the first status line (256 images)
    for pid in process_tree(proc.pid) if target == "every process" else [proc.pid]:
        os.kill(pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    # torchrun (torch.distributed.elastic) forwards the signal, waits for the workers, then raises its own
    # SignalException: exit status 1 and that one traceback. Our workers checkpoint, print no traceback and
    # exit 0 on their own (torchrun had no need to SIGKILL them after its shutdown timeout).
    assert proc.returncode == 1, output
    assert output.count("Traceback") == 1 and "SignalException: Process" in output.split("Traceback")[1], output
    assert "forcefully exiting via SIGKILL" not in output
    assert output.count("Received SIGTERM") == 1, output  # said by rank 0 alone
    newest = checkpoint.list_states(outdir)[0]
    stopped = checkpoint.load_state(newest)
    assert stopped["cur_nimg"] == stopped_at(output) >= 256 and len(set(stopped["rank_digests"])) == 1
    if target == "every process":
        return  # the resume below is the same for both

    result = run_torchrun(train_data, outdir)
    assert f"Resuming from {newest.name} at {stopped['cur_nimg']} images" in result.stdout
    pattern = "network-snapshot-0000001-*.safetensors"
    ignore = ("run_dir", "workers", "status", "duration")
    assert snapshot_contents(outdir, pattern, ignore) == snapshot_contents(ddp_run[0], pattern, ignore)


# --processes: train_edm2.py starting its own ranks (cli.local_launch), as torchrun_command's torchrun does.
def launcher_command(data: Path, outdir: Path, *extra: str) -> list[str]:
    """train_edm2.py starting two Gloo processes of 2 rounds x 8 images itself: torchrun_command's run."""
    return [sys.executable, "train_edm2.py", *TRAIN_ARGS, "--processes=2", "--duration=1Ki", "--batch-gpu=8",
            f"--data={data}", f"--outdir={outdir}", *extra]


def start_launcher(data: Path, outdir: Path, log: Path, *extra: str) -> subprocess.Popen:
    """launcher_command for a 64Ki-image run that a test stops, its output in log: a pipe that nobody reads after
    the launcher is killed would block the ranks."""
    with open(log, "w") as out:
        return subprocess.Popen(launcher_command(data, outdir, "--workers=1", "--status=256", "--duration=64Ki",
                                                 *extra), cwd=REPO, env=train_env(), stdout=out, stderr=subprocess.STDOUT)


def ranks_of(launcher: int) -> dict[int, int]:
    """{rank: process id} of the ranks a launcher started, from their environment."""
    ranks = {}
    for pid in process_tree(launcher)[1:]:
        try:
            environ = dict(item.split("=", 1) for item in
                           Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        except OSError:  # ended meanwhile
            continue
        if environ.get(local_launch.LAUNCHER_ENV) == str(launcher) and "RANK" in environ:
            ranks.setdefault(int(environ["RANK"]), pid)  # a rank's data loader workers share its environment
    return ranks


def running(pid: int) -> bool:
    """Whether a process exists and is no zombie (an orphan's zombie may wait here for a reaper)."""
    try:
        return stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def wait_until_ended(pids: list[int], timeout: float = 120.0) -> None:
    """Wait until none of pids runs; fail when the time runs out."""
    deadline = time.monotonic() + timeout
    while any(running(pid) for pid in pids):
        assert time.monotonic() < deadline, [pid for pid in pids if running(pid)]
        time.sleep(0.05)


def test_processes_train_as_torchrun_does_bit_for_bit(train_data, ddp_run, tmp_path):
    result = subprocess.run(launcher_command(train_data, tmp_path / "run", "--workers=0"), cwd=REPO, env=train_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    assert "Training as 2 processes on this machine (--processes)" in result.stderr
    assert "CPU threads: 1 per process (this machine's cores shared out among the processes" in result.stdout
    assert result.stdout.count("2 process(es) x 2 round(s) x 8 images") == 1  # the first process reports for all
    assert json.loads((tmp_path / "run" / "training_options.json").read_text())["processes"] == 2
    pattern, ignore = "network-snapshot-0000001-*.safetensors", ("run_dir", "workers", "processes")
    assert snapshot_contents(tmp_path / "run", pattern, ignore) == snapshot_contents(ddp_run[0], pattern, ignore)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_every_rank_with_a_training_state(sig, train_data, ddp_run, tmp_path):
    outdir, log = tmp_path / "stopped", tmp_path / "log.txt"
    proc = start_launcher(train_data, outdir, log)
    wait_for(lambda: (outdir / "stats.jsonl").exists(), proc)  # the first status line (256 images)
    proc.send_signal(sig)  # Ctrl-C reaches the launcher alone: the ranks run in a process group of their own
    proc.wait(timeout=120)
    output = log.read_text()
    # SIGTERM: exit 0, as one process does; Ctrl-C: the launcher ends by SIGINT as its ranks did, so scripts stop.
    assert proc.returncode == (0 if sig == signal.SIGTERM else -signal.SIGINT), output
    assert "Traceback" not in output and "Error" not in output and output.count(f"Received {sig.name}") == 1, output
    stopped = checkpoint.load_state(checkpoint.list_states(outdir)[0])
    assert stopped["cur_nimg"] == stopped_at(output) >= 256 and len(set(stopped["rank_digests"])) == 1
    if sig == signal.SIGINT:
        return  # the resume below is the same for both
    result = subprocess.run(launcher_command(train_data, outdir, "--workers=0"), cwd=REPO, env=train_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and f"Resuming from {checkpoint.list_states(outdir)[-1].name}" in result.stdout
    pattern, ignore = "network-snapshot-0000001-*.safetensors", ("run_dir", "workers", "status", "duration",
                                                                 "processes")
    assert snapshot_contents(outdir, pattern, ignore) == snapshot_contents(ddp_run[0], pattern, ignore)


def test_a_killed_launcher_leaves_no_rank_running(train_data, tmp_path):
    outdir, log = tmp_path / "orphaned", tmp_path / "log.txt"
    proc = start_launcher(train_data, outdir, log)
    wait_for(lambda: (outdir / "stats.jsonl").exists() and len(ranks_of(proc.pid)) == 2, proc)
    tree_ = process_tree(proc.pid)
    proc.kill()  # as the OOM killer would
    proc.wait(timeout=60)
    # The kernel sends each rank SIGTERM (PR_SET_PDEATHSIG): it finishes its step, writes a training state, ends;
    # rank 0 alone says so.
    wait_until_ended(tree_)
    output = log.read_text()
    assert output.count("Received SIGTERM") == 1 and "Traceback" not in output, output
    assert checkpoint.load_state(checkpoint.list_states(outdir)[0])["cur_nimg"] == stopped_at(output)


def test_a_rank_killed_by_a_signal_stops_the_others_and_is_named(train_data, tmp_path):
    outdir, log = tmp_path / "failed", tmp_path / "log.txt"
    proc = start_launcher(train_data, outdir, log)
    wait_for(lambda: (outdir / "stats.jsonl").exists() and len(ranks_of(proc.pid)) == 2, proc)
    tree_ = process_tree(proc.pid)
    os.kill(ranks_of(proc.pid)[1], signal.SIGKILL)  # as the OOM killer would
    proc.wait(timeout=120)
    output = log.read_text()
    assert proc.returncode == 128 + signal.SIGKILL, output
    assert "Error: process 1 of 2 was killed by SIGKILL; the others were stopped" in output, output
    assert "Traceback" not in output, output
    wait_until_ended(tree_)


@pytest.mark.bad_input
def test_processes_the_batch_does_not_split_over_are_refused_before_anything_starts(train_data, tmp_path):
    line = assert_refused(tmp_path, lambda: cli([f"--data={train_data}", "--processes=3"], tmp_path / "run"),
                          "--processes")
    assert "batch 32 is not divisible by 3 process(es)" in line


@pytest.mark.parametrize("cores, extra, processes, threads", [
    (2, [], 2, 1), (4, [], 4, 1), (4, ["--threads=2"], 2, 2), (3, [], 2, 1), (64, [], 8, 8), (1, [], 1, None),
])
def test_a_cpu_run_starts_a_process_per_core_unless_told(train_data, tmp_path, monkeypatch, cores, extra, processes,
                                                         threads):
    # Issue 31: processes of one thread keep their speed beside other work; threads of one process do not.
    monkeypatch.delenv("EDM2_PROCESSES")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(local_launch, "cores", lambda: cores)
    result = cli([f"--data={train_data}", "--dry-run", *extra], tmp_path / "run")  # toy-tiny: batch 32
    assert result.exit_code == 0, result.output
    would = f"Would train as {processes} processes on this machine"
    assert (would in result.output) == (processes > 1), result.output
    if threads:
        assert f"CPU threads: {threads} per process" in result.output
    assert json.loads(result.stdout)["processes"] is None  # the default is stored as the default: a rerun elsewhere
    # Under torchrun (here a group of one), torchrun's processes train, whatever --processes says.
    monkeypatch.setenv("WORLD_SIZE", "1")
    result = cli([f"--data={train_data}", "--dry-run", "--processes=2", *extra], tmp_path / "run")
    assert result.exit_code == 0 and "Would train as" not in result.output, result.output


# --ema-shard: the files of a run do not depend on it (it is no hyperparameter, and their options say it).
SHARD_IGNORE = ("run_dir", "workers", "duration", "ema_shard")


def run_torchrun(data: Path, outdir: Path, *extra: str) -> subprocess.CompletedProcess:
    """torchrun_command run to its end; it must succeed without a traceback."""
    result = subprocess.run(torchrun_command(data, outdir, "--workers=0", *extra), cwd=REPO, env=train_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    return result


def assert_same_ema_tracks(a: Path, b: Path) -> None:
    """Two training states hold the same EMA tracks and network weights, bit for bit."""
    a, b = checkpoint.load_state(a), checkpoint.load_state(b)
    assert a["ema"]["stds"] == b["ema"]["stds"] and len(a["ema"]["emas"]) == len(b["ema"]["emas"]) == 2
    for x, y in [*zip(a["ema"]["emas"], b["ema"]["emas"]), (a["net"], b["net"])]:
        assert list(x) == list(y) and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def sharded_run(train_data, tmp_path_factory) -> tuple[Path, str]:
    """ddp_run's run stopped at 512 images, then resumed with --ema-shard (each of the two processes keeps half of
    every EMA track) to write its snapshots and training state at 1024, made once for the session; and the resumed
    run's output."""
    def build(folder: Path) -> str:
        run_torchrun(train_data, folder / "sharded", "--duration=512")
        return run_torchrun(train_data, folder / "sharded", "--ema-shard").stdout

    folder, output = built_once(tmp_path_factory, "sharded-run", build)
    return folder / "sharded", output


def test_ema_shard_resumes_a_whole_state_and_writes_bitwise_the_unsharded_runs_files(sharded_run, ddp_run):
    outdir, output = sharded_run
    assert "Resuming from training-state-0000000-512.pt at 512 images" in output
    assert "; each process keeps 1/2 of the EMA tracks" in output
    pattern = "network-snapshot-0000001-*.safetensors"
    assert len(snapshot_contents(outdir, pattern, SHARD_IGNORE)) == 2
    assert snapshot_contents(outdir, pattern, SHARD_IGNORE) == snapshot_contents(ddp_run[0], pattern, SHARD_IGNORE)
    assert_same_ema_tracks(outdir / "training-state-0000001.pt", ddp_run[0] / "training-state-0000001.pt")


def test_ema_shard_is_stored_and_read_back_by_config(sharded_run, ddp_run):
    for run, shard in [(sharded_run[0], True), (ddp_run[0], False)]:
        assert json.loads((run / "training_options.json").read_text())["ema_shard"] is shard
        result = CliRunner().invoke(train_edm2.main, [f"--config={run / 'training_options.json'}", "--dry-run"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["ema_shard"] is shard
    help_text = " ".join(CliRunner().invoke(train_edm2.main, ["--help"]).output.split())
    assert "with one process it changes nothing" in help_text


def test_a_state_written_sharded_resumes_with_one_process(train_data, sharded_run, ddp_run, tmp_path):
    # One process draws other data and noise than two, so the reference is the unsharded run's state resumed alike;
    # --ema-shard with one process is accepted and changes nothing.
    for name, source, extra in [("sharded", sharded_run[0], ["--ema-shard"]), ("whole", ddp_run[0], [])]:
        shutil.copytree(source, tmp_path / name)
        result = cli([f"--data={train_data}", "--duration=1088", "--grid=0", *extra], tmp_path / name)
        assert result.exit_code == 0 and "Resuming from training-state-0000001.pt at 1024 images" in result.output
        assert "EMA tracks" not in result.output
    pattern = "network-snapshot-0000001-1088-*.safetensors"
    resumed = snapshot_contents(tmp_path / "sharded", pattern, SHARD_IGNORE)
    assert len(resumed) == 2 and resumed == snapshot_contents(tmp_path / "whole", pattern, SHARD_IGNORE)
    assert_same_ema_tracks(*(tmp_path / name / "training-state-0000001-1088.pt" for name in ("sharded", "whole")))


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "data: no such"),
        ("unlabeled", "--cond=True but"),
        ("mixed", "mixed resolutions"),
    ],
)
def test_bad_data(case, message, tmp_path):
    data = tmp_path / "data"
    if case != "missing":
        write_image_dataset(data, num=16, labels=case != "unlabeled", sizes=[8, 16] if case == "mixed" else None)
    assert_refused(tmp_path, lambda: cli([f"--data={data}"], tmp_path / "run"), message)


@pytest.mark.parametrize("mode, channels", [("L", 1), ("RGBA", 4)])
def test_png_data_of_any_channel_count_trains_with_that_many_channels(mode, channels, tmp_path):
    data = write_image_dataset(tmp_path / "data", num=16, mode=mode)
    result = cli([f"--data={data}", "--dry-run"], tmp_path / "run")
    assert result.exit_code == 0, result.output
    options = json.loads(result.output[: result.output.rindex("}") + 1])
    assert options["dataset"]["num_channels"] == channels and options["encoder"] == {"class": "StandardRGBEncoder"}


# Every option is refused by its type or a check before any work; each message names the option.
BAD_OPTIONS = [
    (["--P_mean=nan"], "--P_mean", "'nan' is not a finite number"),
    (["--P_mean=inf"], "--P_mean", "'inf' is not a finite number"),
    (["--P_mean=-1e999"], "--P_mean", "not a finite number"),
    (["--P_std=inf"], "--P_std", "not a finite number"),
    (["--P_std=nan"], "--P_std", "not a finite number"),
    (["--P_std=0"], "--P_std", "0.0 is not in the range x>0"),
    (["--lr=nan"], "--lr", "not a finite number"),
    (["--lr=inf"], "--lr", "not a finite number"),
    (["--lr=0"], "--lr", "0.0 is not in the range x>0"),
    (["--dropout=nan"], "--dropout", "not a finite number"),
    (["--dropout=1"], "--dropout", "1.0 is not in the range 0<=x<1"),
    (["--label-dropout=1"], "--label-dropout", "1.0 is not in the range 0<=x<1"),
    (["--label-dropout=-0.1"], "--label-dropout", "-0.1 is not in the range 0<=x<1"),
    (["--label-dropout=nan"], "--label-dropout", "not a finite number"),
    (["--label-dropout=0.1", "--cond=False"], "--label-dropout", "needs a class-conditional run (--cond=True)"),
    (["--text-dropout=1"], "--text-dropout", "1.0 is not in the range 0<=x<1"),
    (["--text-attention-kind=sideways"], "--text-attention-kind", "'sideways' is not one of 'cross', 'fused'"),
    (["--decay=nan"], "--decay", "not a finite number"),
    (["--decay=inf"], "--decay", "not a finite number"),
    (["--decay=-1"], "--decay", "-1.0 is not in the range x>=0"),
    (["--ls=inf"], "--ls", "not a finite number"),
    (["--ls=nan"], "--ls", "not a finite number"),
    (["--duration=0"], "--duration", "fewer than 1 image"),
    (["--duration=2Kx"], "--duration", "is not an image count"),
    (["--duration=-5"], "--duration", "is not an image count"),
    (["--status=1.5Ki"], "--status", "is not an image count"),
    (["--batch=0"], "--batch", "0 is not in the range 1<=x<=1048576"),
    (["--channels=0"], "--channels", "0 is not in the range 1<=x<=4096"),
    (["--seed=-1"], "--seed", "-1 is not in the range 0<=x<=4294967295"),
    (["--workers=-1"], "--workers", "-1 is not in the range 0<=x<=1024"),
    (["--cond=maybe"], "--cond", "'maybe' is not a valid boolean"),
    (["--precision=fp8"], "--precision", "'fp8' is not one of 'fp32', 'fp16', 'bf16'"),
    (["--preset=toy-nope"], "--preset", "'toy-nope' is not one of"),
    (["--batch-gpu=5"], "--batch", "batch 32 is not divisible by 1 process(es) x batch-gpu 5"),
    (["--batch-gpu=64"], "--batch", "batch 32 is not divisible by 1 process(es) x batch-gpu 64"),
    (["--channel-mult=1,0"], "--channel-mult", "'1,0': every number must lie in [1, 64]"),
    (["--channel-mult="], "--channel-mult", "needs at least one number"),
    (["--channel-mult=1;2"], "--channel-mult", "'1;2' is not a comma-separated list of integers"),
    (["--channel-mult=1.5"], "--channel-mult", "is not a comma-separated list of integers"),
    (["--num-blocks=0"], "--num-blocks", "0 is not in the range 1<=x<=64"),
    (["--attn-resolutions=x"], "--attn-resolutions", "'x' is not a comma-separated list of integers"),
    (["--attn-resolutions=4,-4"], "--attn-resolutions", "every number must lie in [1, 8192]"),
    (["--rampup=-0.5"], "--rampup", "-0.5 is not in the range x>=0"),
    (["--rampup=nan"], "--rampup", "'nan' is not a finite number"),
    (["--ema-stds=0.05,0.3"], "--ema-stds", "0.3 is outside (0, 0.2887)"),
    (["--ema-stds=0.05,0.0502"], "--ema-stds", "0.05 and 0.0502 would share the file name suffix 0.050"),
    (["--ema-stds="], "--ema-stds", "is not a comma-separated list of numbers"),
]


@pytest.mark.bad_input
@pytest.mark.parametrize("args, option, message", BAD_OPTIONS, ids=[" ".join(a) for a, _, _ in BAD_OPTIONS])
def test_bad_option(args, option, message, train_data, tmp_path):
    assert_one_error_line(cli([f"--data={train_data}", *args], tmp_path / "run"), f"Invalid value for '{option}", message)
    assert tree(tmp_path) == []


# Architectures the 8x8 training data cannot have (toy-tiny: levels 8 and 4, 16 channels, heads of 16): one line
# naming the option, before anything is written.
BAD_ARCHITECTURES = [
    (["--channel-mult=1,2,2,2,2"], "--channel-mult=1,2,2,2,2 has 5 levels: the resolution 8 must be divisible by "
                                   "2^4 = 16 (data 8x8)"),
    (["--attn-resolutions=16"], "attention at 16x16, but the U-Net's levels are 8x8, 4x4: choose --attn-resolutions "
                                "among them"),
    (["--channel-mult=1,2,4", "--attn-resolutions=4,1"], "attention at 1x1, but the U-Net's levels are 8x8, 4x4, 2x2"),
    (["--channel-mult=1"], "attention at 4x4, but the U-Net's levels are 8x8:"),  # the preset's attention at 4x4
    (["--attn-resolutions=8", "--channels=8"], "attention at 8x8 splits --channels=8 x 1 = 8 channels into heads "
                                               "of 16"),
    (["--channels=35"], "attention at 4x4 splits --channels=35 x 2 = 70 channels into heads of 16"),
    (["--text-attention=16"], "text attention at 16x16, but the U-Net's levels are 8x8, 4x4: choose --text-attention "
                              "among them"),
    (["--text-attention=4"], "--text-attention shapes the attention over a caption's tokens, but the data has no text "
                             "embeddings"),
    (["--text-attention-kind=fused"], "--text-attention-kind shapes the attention over a caption's tokens"),
]


@pytest.mark.bad_input
@pytest.mark.parametrize("args, message", BAD_ARCHITECTURES, ids=[" ".join(a) for a, _ in BAD_ARCHITECTURES])
def test_impossible_architecture(args, message, train_data, tmp_path):
    assert_one_error_line(cli([f"--data={train_data}", *args], tmp_path / "run"), message)
    assert tree(tmp_path) == []


def test_architecture_options_are_the_networks(train_data, tmp_path):
    result = cli([f"--data={train_data}", "--dry-run", "--channel-mult=1,1,2", "--num-blocks=2",
                  "--attn-resolutions="], tmp_path / "run")
    assert result.exit_code == 0, result.output
    network = json.loads(result.output[: result.output.rindex("}") + 1])["network"]
    # The preset's other U-Net arguments stay.
    assert network == dict(channel_mult=[1, 1, 2], num_blocks=2, attn_resolutions=[], channels_per_head=16)


@pytest.mark.bad_input
@pytest.mark.parametrize("case", ["outdir is a file", "outdir under a file", "locked here", "locked elsewhere",
                                  "locked, its file naming nobody"])
def test_bad_outdir(case, train_data, tmp_path):
    outdir = tmp_path / "run"
    lock = RunLock(outdir)
    if case == "outdir is a file":
        outdir.write_text("")
        fragments = (f"{outdir} is a file, not a folder",)
    elif case == "outdir under a file":
        (tmp_path / "file").write_text("")
        outdir = tmp_path / "file" / "run"
        fragments = (f"lies under {tmp_path / 'file'}, which is a file",)
    elif case == "locked here":  # held by this process, as by another training
        lock.acquire()
        fragments = (f"{outdir} is in use by the training process {os.getpid()} on host", "wait for it to end")
    elif case == "locked elsewhere":  # a holder on another host, whose process id means nothing here
        lock.acquire()
        (outdir / LOCK_FILE).write_text(json.dumps(dict(what="training", host="node-elsewhere", pid=1234,
                                                        started="2024-05-01 12:00:00")))
        fragments = ("the training process 1234 on host node-elsewhere (since 2024-05-01 12:00:00); wait for it",)
    else:  # the damaged lock files: a pid of 10**23 digits
        lock.acquire()
        (outdir / LOCK_FILE).write_text('{"what": "training", "host": "h", "pid": 1' + "0" * 23 + "}")
        fragments = (f"{outdir} is in use by another process ({outdir / LOCK_FILE}: the number 1", "more than 20 digits")
    try:
        assert_refused(tmp_path, lambda: cli([f"--data={train_data}"], outdir), *fragments)
    finally:
        lock.release()


def in_namespace(mount: str, *command: str, then: str = "") -> subprocess.CompletedProcess:
    """Run command in a private mount namespace (unshare -rm) after `mount`, then the shell code `then`, which
    sees the command's exit status as $STATUS; skip where mounting is not allowed."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare to mount a filesystem")
    script = f'{mount} || exit 99; "$@"; STATUS=$?; {then or "exit $STATUS"}'
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *command], cwd=REPO, env=train_env(),
                            capture_output=True, text=True, timeout=300)
    if result.returncode == 99:
        pytest.skip(f"cannot mount here: {result.stderr.strip()}")
    return result


@pytest.mark.bad_input
def test_read_only_outdir(train_data, tmp_path):
    (tmp_path / "ro").mkdir()
    assert_refused(tmp_path, lambda: in_namespace(f"mount -t tmpfs -o ro tmpfs {tmp_path / 'ro'}", sys.executable,
                                                  "train_edm2.py", *TRAIN_ARGS, f"--data={train_data}",
                                                  f"--outdir={tmp_path / 'ro' / 'run'}"),
                   f"{tmp_path / 'ro' / 'run'}: cannot write in {tmp_path / 'ro'}", "Read-only file system")


# Run inside the namespace after a training on the tiny disk: what the run directory holds, and that
# every snapshot in it loads.
LIST_RUN = ("import json, pathlib, sys; from edm2.formats.snapshot import load_network; "
            "run = pathlib.Path(sys.argv[1]); print('FILES', json.dumps(sorted(p.name for p in run.iterdir()))); "
            "[load_network(p) for p in run.glob('*.safetensors')]; print('LOADED')")


@pytest.mark.bad_input
def test_full_disk_during_training(train_data, tmp_path):
    # 1 MiB holds the options, log, stats, the first two snapshots (about 360 KiB each), the dashboard (about
    # 90 KiB) and the sample grid (about 6 KiB), not the first training state (about 3.6 MiB): the run fails at
    # 1024 images, with one line and no partial file.
    disk = tmp_path / "disk"
    disk.mkdir()
    result = in_namespace(
        f"mount -t tmpfs -o size=1m tmpfs {disk}",
        sys.executable, "train_edm2.py", *TRAIN_ARGS, "--workers=0", f"--data={train_data}", f"--outdir={disk / 'run'}",
        then=f'{sys.executable} -c "{LIST_RUN}" {disk / "run"} >&2; exit $STATUS',
    )
    assert_one_error_line(result, f"{disk / 'run' / 'training-state-0000001.pt'}: No space left on device")
    assert "LOADED" in result.stderr, result.stderr
    files = json.loads(result.stderr.split("FILES ", 1)[1].splitlines()[0])
    assert files == ["log.txt", "network-snapshot-0000001-0.050.safetensors",
                     "network-snapshot-0000001-0.100.safetensors", "plots", "samples", "stats.jsonl",
                     "training_options.json"]


def test_dry_run_prints_options_and_writes_nothing(train_data, tmp_path):
    result = cli([f"--data={train_data}", "--dry-run", "--lr=0.003"], tmp_path / "run")
    assert result.exit_code == 0, result.output
    options = json.loads(result.output[: result.output.rindex("}") + 1])
    assert options["lr"] == 0.003 and options["preset"] == "toy-tiny" and options["batch"] == 32
    assert not (tmp_path / "run").exists()


def test_help_shows_examples():
    result = CliRunner().invoke(train_edm2.main, ["--help"])
    assert result.exit_code == 0 and "torchrun --standalone --nproc_per_node=8 train_edm2.py" in result.output


def test_label_dropout_run_resumes_bit_identically_and_differs_from_a_run_without(train_data, tmp_path):
    short = ["--workers=0", "--snapshot=128", "--checkpoint=128", "--status=128"]
    dropout = "--label-dropout=0.5"
    # Stopped after half by its duration, then the same command with the longer duration resumes it.
    assert run_training(train_data, tmp_path / "resumed", *short, dropout, "--duration=128").returncode == 0
    result = run_training(train_data, tmp_path / "resumed", *short, dropout, "--duration=256")
    assert result.returncode == 0 and "Resuming from training-state-0000000-128.pt at 128 images" in result.stdout
    for name, extra in [("whole", [dropout]), ("plain", [])]:
        assert run_training(train_data, tmp_path / name, *short, *extra, "--duration=256").returncode == 0
    pattern, ignore = "network-snapshot-0000000-256-*.safetensors", ("run_dir", "workers", "duration")
    whole = snapshot_contents(tmp_path / "whole", pattern, ignore)
    assert len(whole) == 2 and snapshot_contents(tmp_path / "resumed", pattern, ignore) == whole
    assert all(meta["training_options"]["label_dropout"] == 0.5 for _, meta in whole.values())
    plain = snapshot_contents(tmp_path / "plain", pattern, ignore)
    assert all(whole[name][0] != plain[name][0] for name in whole)  # the dropped labels changed the weights


def test_rampup_and_ema_stds_set_the_learning_rate_ramp_and_the_snapshots(train_data, tmp_path):
    # 64 images in batches of 32; the stats row at 64 images reports the rate of the step that started at 32.
    result = run_training(train_data, tmp_path / "run", "--workers=0", "--duration=64", "--status=32",
                          "--snapshot=64", "--checkpoint=64", "--rampup=0.000128", "--ema-stds=0.12,0.07")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "stats.jsonl").read_text().splitlines()]
    lr = {row["nimg"]: row["lr"] for row in rows}
    # Eq. 67 with toy-tiny's lr 0.01, ramped over 128 images (the preset's 500 would give 0.01 * 32 / 500).
    assert lr[64] == pytest.approx(0.01 * 32 / 128, rel=1e-12)
    names = sorted(p.name for p in (tmp_path / "run").glob("network-snapshot-*.safetensors"))
    assert [name[-len("0.070.safetensors"):] for name in names] == ["0.070.safetensors", "0.120.safetensors"]


def test_resuming_with_another_rampup_or_ema_stds_is_refused(train_data, reference_run, tmp_path):
    outdir = tmp_path / "copy"
    shutil.copytree(reference_run, outdir)
    result = cli([f"--data={train_data}", "--rampup=0.001", "--ema-stds=0.05"], outdir)
    assert assert_one_error_line(result) == (
        f"Error: {outdir}: cannot resume with different hyperparameters "
        "(rampup_Mimg: run has 0.0005, now 0.001, ema_stds: run has [0.05, 0.1], now [0.05])"
    )
