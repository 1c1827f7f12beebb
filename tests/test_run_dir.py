"""The run directory: its lock, file names that never collide, stats.jsonl that survives kills and full disks,
and the clean-up of temporaries and fruitless starts."""

import dataclasses
import errno
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from edm2.snapshot import images_tag
from training import checkpoint, run_dir
from training.run_dir import RunDirectory
from training.run_lock import LOCK_FILE, Holder, RunLock, RunLocked
from tests.helpers import dead_pid


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
    with pytest.raises(RunLocked, match=f"{tmp_path} is in use by the training process {os.getpid()} on host"):
        RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    second = RunLock(tmp_path)
    second.acquire()
    second.release()


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    write_lock(tmp_path, host="elsewhere", pid=1)  # removed by hand and taken by another training
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == "elsewhere"


@pytest.mark.parametrize("case", ["process ended", "process id reused", "host rebooted", "empty and old"])
def test_stale_lock_is_removed(case, tmp_path):
    me = Holder.this_process()
    if case == "process ended":
        write_lock(tmp_path, host=me.host, pid=dead_pid(), started="then")
    elif case == "process id reused":  # our id, but the lock's process started at another time
        if me.start_ticks is None:
            pytest.skip("no process start times on this system")
        write_lock(tmp_path, **dict(dataclasses.asdict(me), start_ticks=me.start_ticks + 1))
    elif case == "host rebooted":
        if not me.boot_id:
            pytest.skip("no boot id on this system")
        write_lock(tmp_path, **dict(dataclasses.asdict(me), boot_id="another-boot"))
    else:  # a creator killed between creating the file and writing it
        (tmp_path / LOCK_FILE).write_bytes(b"")
        os.utime(tmp_path / LOCK_FILE, (time.time() - 3600,) * 2)
    reports = []
    lock = RunLock(tmp_path)
    lock.acquire(report=reports.append)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert len(reports) == 1 and reports[0].startswith("Removed the stale lock of")
    lock.release()


def test_live_and_foreign_locks_are_honoured(tmp_path):
    write_lock(tmp_path, host="node-elsewhere", pid=dead_pid(), started="2024-05-01 12:00:00")
    pid = json.loads((tmp_path / LOCK_FILE).read_text())["pid"]
    with pytest.raises(RunLocked) as info:  # another host's process cannot be checked from here
        RunLock(tmp_path).acquire()
    assert str(info.value) == (
        f"{tmp_path} is in use by the training process {pid} on host node-elsewhere (since 2024-05-01 12:00:00); "
        f"if that training is no longer running (its host went down), delete {tmp_path / LOCK_FILE}"
    )
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(tmp_path, host=socket.gethostname(), pid=sleeper.pid)
        with pytest.raises(RunLocked, match=f"process {sleeper.pid} on host .*; wait for it to end or stop it"):
            RunLock(tmp_path).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_stale_breaker_guard_is_cleared(tmp_path):
    # A process killed while removing a stale lock leaves training.lock.break; after a minute it is cleared.
    write_lock(tmp_path, host=socket.gethostname(), pid=dead_pid())
    guard = tmp_path / (LOCK_FILE + ".break")
    guard.write_bytes(b"")
    os.utime(guard, (time.time() - 120,) * 2)
    lock = RunLock(tmp_path)
    lock.acquire(report=lambda _: None)
    assert not guard.exists()
    lock.release()


def test_open_locks_cleans_temporaries_and_undoes_a_fruitless_start(tmp_path):
    path = tmp_path / "runs" / "new"
    with pytest.raises(RuntimeError, match="failed"):
        with RunDirectory.open(path) as run:
            assert (path / LOCK_FILE).is_file() and run.created == [tmp_path / "runs", path]
            (path / "log.txt").write_text("started\n")
            raise RuntimeError("failed")
    assert not (tmp_path / "runs").exists()

    path.mkdir(parents=True)
    stale = [path / ".training-state-0000001.pt.999999@elsewhere.x1.tmp", path / ".stats.jsonl.1@host.x2.tmp"]
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
