"""The run directory: its lock, file names that never collide, stats.jsonl that survives kills and full disks,
and the clean-up of temporaries and fruitless starts."""

import errno
import json
import os
import socket
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from click.testing import CliRunner

import train_edm2
from edm2.formats.snapshot import images_tag
from edm2.runtime import files
from edm2.runtime.locks import DestinationInUse
from training.run import checkpoint, run_dir
from training.options import TrainingOptions
from training.run.checkpoint import Checkpoints
from training.run.run_dir import LOCK_FILE, RunDirectory, RunLock
from tests.helpers import REPO, TRAIN_ARGS, assert_refused, dead_pid, train_env


def test_names_keep_the_release_look_and_never_collide():
    # Multiples of 1024 (every count of the release's batch-2048 presets) keep the release's kimg names.
    assert images_tag(2048) == "0000002" and images_tag(128 << 20) == "0134217"
    # The case: a SIGTERM checkpoint at 2624 images and the regular one at 2048 (both kimg 2).
    assert checkpoint.state_path("run", 2624).name == "training-state-0000002-2624.pt"
    assert checkpoint.state_path("run", 2048).name == "training-state-0000002.pt"
    assert run_dir.snapshot_path("run", 1504, 0.05).name == "network-snapshot-0000001-1504-0.050.safetensors"
    counts = [*range(0, 200_000, 32), *range(0, 200_000, 1000), 2**31, 2**31 + 64]
    tags = {images_tag(n) for n in counts}
    assert len(tags) == len(set(counts))
    for n in counts:  # the name tells the count back
        kimg, _, exact = images_tag(n).partition("-")
        assert checkpoint.tagged_images(kimg, exact or None) == n


def test_states_are_ordered_by_images_also_with_older_names(tmp_path):
    # training-state-0000003.pt is how older versions named a state at 3xxx images; it sorts as 3072.
    names = ["training-state-0000000-576.pt", "training-state-0000002.pt", "training-state-0000002-2624.pt",
             "training-state-0000003.pt", "training-state-0000003-3100.pt", "other.pt"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in checkpoint.list_states(tmp_path)] == [
        "training-state-0000003-3100.pt", "training-state-0000003.pt", "training-state-0000002-2624.pt",
        "training-state-0000002.pt", "training-state-0000000-576.pt",
    ]


def write_lock(folder, **fields) -> None:
    (folder / LOCK_FILE).write_text(json.dumps(fields))


def test_lock_is_exclusive_names_its_holder_and_is_released(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and holder["started"]
    with pytest.raises(DestinationInUse, match=f"{tmp_path} is in use by the training process {os.getpid()} on host"):
        RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    second = RunLock(tmp_path)
    second.acquire()
    second.release()


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    (tmp_path / LOCK_FILE).unlink()  # removed by hand and taken by another training
    write_lock(tmp_path, host="elsewhere", pid=1)
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == "elsewhere"


# What the lock file of a training that ended without releasing it (SIGKILL, power loss) may name; none of it is
# looked at, as nobody holds the lock.
ENDED = {
    "a process that ended": dict(what="training", host=socket.gethostname(), pid="dead", started="then"),
    "this process (an id used again)": dict(what="training", host=socket.gethostname(), pid=os.getpid(),
                                            started="then"),
    "process 1 (another PID namespace)": dict(what="training", host=socket.gethostname(), pid=1, started="then"),
    "an older version's fields": dict(host=socket.gethostname(), pid=1, boot_id="x", start_ticks=5, started="then"),
    "nothing (killed before writing it)": None,
}


@pytest.mark.parametrize("case", ENDED)
def test_a_lock_that_nobody_holds_is_taken(case, tmp_path):
    fields = ENDED[case] and dict(ENDED[case], pid=dead_pid() if ENDED[case]["pid"] == "dead" else ENDED[case]["pid"])
    if fields is None:
        (tmp_path / LOCK_FILE).write_bytes(b"")
    else:
        write_lock(tmp_path, **fields)
    reports = []
    lock = RunLock(tmp_path)
    lock.acquire(report=reports.append)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    named = fields is not None and "what" in fields
    assert reports == ([f"Took over {LOCK_FILE} from the training process {fields['pid']} on host "
                        f"{socket.gethostname()} (since then), which ended."] if named else [])
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_held_lock_is_honoured_whatever_host_and_process_it_names(tmp_path):
    holder = RunLock(tmp_path)
    holder.acquire()
    write_lock(tmp_path, what="training", host="node-elsewhere", pid=dead_pid(), started="2024-05-01 12:00:00")
    pid = json.loads((tmp_path / LOCK_FILE).read_text())["pid"]
    with pytest.raises(DestinationInUse) as info:
        RunLock(tmp_path).acquire()
    holder.release()
    assert str(info.value) == (f"{tmp_path} is in use by the training process {pid} on host node-elsewhere "
                               "(since 2024-05-01 12:00:00); wait for it to end or stop it")


def test_open_locks_cleans_temporaries_and_undoes_a_fruitless_start(tmp_path):
    path = tmp_path / "runs" / "new"
    with pytest.raises(RuntimeError, match="failed"):
        with RunDirectory.open(path) as run:
            assert (path / LOCK_FILE).is_file() and run.created == [tmp_path / "runs", path]
            (path / "log.txt").write_text("started\n")
            for folder in ("tensorboard", "wandb"):  # what --logger writes before the first snapshot
                (path / folder).mkdir()
                (path / folder / "events").write_text("logged\n")
            (path / "wandb-run.json").write_text("{}")
            raise RuntimeError("failed")
    assert not (tmp_path / "runs").exists()

    # The trackers' files of an earlier start are not this start's to remove.
    path.mkdir(parents=True)
    (path / "tensorboard").mkdir()
    (path / "wandb-run.json").write_text("{}")
    with pytest.raises(RuntimeError, match="failed"):
        with RunDirectory.open(path):
            (path / "wandb").mkdir()
            raise RuntimeError("failed")
    assert sorted(p.name for p in path.iterdir()) == ["tensorboard", "wandb-run.json"]
    shutil.rmtree(path)

    path.mkdir(parents=True)
    stale = [path / files.temporary_name("", ".training-state-0000001.pt.999999@elsewhere."),
             path / files.temporary_name("", ".stats.jsonl.1@host.")]
    for tmp in stale:
        tmp.write_bytes(b"partial")
    reports = []
    with RunDirectory.open(path, report=reports.append) as run:
        run.has_results = True
    assert sorted(p.name for p in path.iterdir()) == []
    assert reports == [f"Removed {tmp.name}, left by an interrupted write." for tmp in sorted(stale)]


def test_torn_and_later_stats_rows_are_dropped(tmp_path):
    rows = [json.dumps({"kimg": n / 1000, "nimg": n, "loss": 1.0}) for n in (512, 1024, 1536)]
    stats = tmp_path / "stats.jsonl"
    stats.write_text("\n".join(rows) + "\n" + rows[2][:17])  # a kill in mid-append
    run = RunDirectory(tmp_path)
    run.trim_stats(2048)
    assert stats.read_text() == "\n".join(rows) + "\n"
    stats.write_text("\n".join(rows) + "\n" + rows[2][:17])
    run.trim_stats(1024)  # a resume from 1024 images also drops the rows written after that state
    assert stats.read_text() == "\n".join(rows[:2]) + "\n"
    run.append_stats({"nimg": 1056})
    assert [json.loads(line)["nimg"] for line in stats.read_text().splitlines()] == [512, 1024, 1056]


def test_a_failed_stats_append_leaves_no_partial_row(tmp_path, monkeypatch):
    run = RunDirectory(tmp_path)
    run.append_stats({"nimg": 32})
    before = (tmp_path / "stats.jsonl").read_bytes()
    real_write = os.write

    def disk_fills(fd, data):  # the first write lands in part, the next finds the disk full
        if len(data) > 4:
            return real_write(fd, bytes(data[:4]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(run_dir.os, "write", disk_fills)
    with pytest.raises(OSError, match="No space left on device") as info:
        run.append_stats({"nimg": 64, "loss": 0.5})
    assert info.value.filename == str(tmp_path / "stats.jsonl")
    assert (tmp_path / "stats.jsonl").read_bytes() == before


def tiny_options(run: Path) -> TrainingOptions:
    """toy-tiny's options for 8x8 RGB data with 4 classes, run in `run`."""
    return TrainingOptions.from_preset("toy-tiny", dict(resolution=8, num_channels=3, label_dim=4),
                                       {"class": "StandardRGBEncoder"}, run_dir=str(run), data="data")


def accept_any(state: dict, path: Path) -> None:
    """A Checkpoints.newest check that finds every state's tensors fit (the fake states hold none)."""


def fake_state(opts: TrainingOptions, cur_nimg: int, **extra) -> dict:
    """A training state with empty weights: what Checkpoints.newest reads of one."""
    hyperparameters = opts.hyperparameters()
    return dict(net={}, optimizer={}, ema={}, cur_nimg=cur_nimg, elapsed_s=0.0,
                options=json.dumps(hyperparameters, sort_keys=True),
                options_hash=checkpoint.options_hash(hyperparameters), **extra)


def test_a_run_gets_an_identity_at_its_start_and_keeps_it_on_resume(tmp_path):
    opts = tiny_options(tmp_path)
    first, other = RunDirectory(tmp_path), RunDirectory(tmp_path / "other")
    assert Checkpoints(first).newest(opts, accept_any) == (None, None)
    assert Checkpoints(other).newest(opts, accept_any) == (None, None)
    assert run_dir.RUN_ID.fullmatch(first.run_id) and first.run_id != other.run_id
    # Started, killed before its first training state: the next start keeps training_options.json's identity.
    run_dir.save_options(tmp_path, first.options_json(opts))
    again = RunDirectory(tmp_path)
    checkpoints = Checkpoints(again)
    checkpoints.newest(opts, accept_any)
    assert again.run_id == first.run_id
    # Every training state carries it, and a resume takes it from the state it resumes from.
    state_file = checkpoints.write(fake_state(opts, 1024))
    assert checkpoint.load_state(state_file)["run_id"] == first.run_id
    run_dir.save_options(tmp_path, dict(opts.to_json(), run_id="0" * 32))
    resumed = RunDirectory(tmp_path)
    assert Checkpoints(resumed).newest(opts, accept_any)[0] == state_file and resumed.run_id == first.run_id


def test_a_run_begun_before_run_ids_gets_one_on_resume(tmp_path):
    opts = tiny_options(tmp_path)
    run_dir.save_options(tmp_path, opts.to_json())
    checkpoint.save_state(checkpoint.state_path(tmp_path, 1024), fake_state(opts, 1024))
    run = RunDirectory(tmp_path)
    assert Checkpoints(run).newest(opts, accept_any)[1]["cur_nimg"] == 1024 and run_dir.RUN_ID.fullmatch(run.run_id)


@pytest.mark.bad_input
@pytest.mark.parametrize("run_id", ["../../etc", 5, "A" * 32])
def test_a_stored_run_id_that_is_not_one_is_refused(tmp_path, run_id):
    opts = tiny_options(tmp_path)
    path = checkpoint.state_path(tmp_path, 1024)
    checkpoint.save_state(path, fake_state(opts, 1024, run_id=run_id))
    with pytest.raises(checkpoint.CheckpointError, match=f"^{path}: its run_id .* is not 32 hex digits$"):
        Checkpoints(RunDirectory(tmp_path)).newest(opts, accept_any)


# Holds a run directory the way a training does, until its standard input closes.
HOLD = """
import sys
from training.run.run_dir import RunDirectory
with RunDirectory.open(sys.argv[1]) as run:
    run.has_results = True
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.mark.bad_input
def test_a_refused_start_touches_nothing_of_the_training_that_holds_the_run(train_data, tmp_path):
    run = tmp_path / "runs" / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], cwd=REPO, env=train_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        for name in ("log.txt", "training_options.json", "stats.jsonl"):
            (run / name).write_text(f"the running training's {name}\n")
        before = {p.name: p.read_bytes() for p in run.iterdir()}
        # The same directory by another path, through a folder that does not exist yet.
        other_path = tmp_path / "runs" / "new" / ".." / "run"
        assert_refused(tmp_path, lambda: CliRunner().invoke(train_edm2.main, [
            *TRAIN_ARGS, f"--data={train_data}", f"--outdir={other_path}", "--workers=0"]),
            f"{run} is in use by the training process {holder.pid}")
        assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
