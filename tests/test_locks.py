"""One writer per destination: the kernel lock refuses a second writer, whatever process ids its file names, and
is free again the moment its holder ends."""

import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from edm2.runtime import locks
from edm2.runtime.locks import FOLDER_LOCK, DestinationInUse, DestinationLock, hold_destination
from tests.helpers import REPO, dead_pid, lock_held_by_child


def named(lock_file) -> dict:
    return json.loads(lock_file.read_text())


def test_a_second_writer_is_refused_and_the_first_leaves_nothing(tmp_path):
    dest = tmp_path / "out.zip"
    first = DestinationLock(dest, "dataset_tool.py toy")
    first.acquire()
    assert first.path == tmp_path / ".out.zip.lock"
    assert named(first.path) == dict(what="dataset_tool.py toy", host=socket.gethostname(), pid=os.getpid(),
                                     started=named(first.path)["started"])
    # Another open file of the same process counts as another writer, as another process does.
    with pytest.raises(DestinationInUse) as info:
        DestinationLock(dest, "dataset_tool.py toy").acquire()
    assert str(info.value) == (f"{dest} is in use by the dataset_tool.py toy process {os.getpid()} on host "
                               f"{socket.gethostname()} (since {named(first.path)['started']}); wait for it to end "
                               f"or stop it")
    first.release()
    assert list(tmp_path.iterdir()) == []
    with hold_destination(dest, "again"):
        assert named(first.path)["what"] == "again"
    assert list(tmp_path.iterdir()) == []


def test_a_folder_lock_creates_its_folder_and_removes_it_while_empty(tmp_path):
    with hold_destination(tmp_path / "a" / "b", "generate.py", FOLDER_LOCK) as lock:
        assert lock.path == tmp_path / "a" / "b" / FOLDER_LOCK and lock.path.is_file()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError):
        with hold_destination(tmp_path / "a" / "b", "generate.py", FOLDER_LOCK):
            (tmp_path / "a" / "b" / "000000.png").write_bytes(b"result")
            raise RuntimeError("failed later")
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["000000.png"]  # results stay; the lock goes


@pytest.mark.parametrize("names", ["a dead process of this host", "process 1 of this host"])
def test_a_live_holder_is_honoured_whatever_process_its_file_names(tmp_path, names):
    # A holder in another PID namespace (a container with this host's name) writes a process id that here is
    # dead or another process; only the kernel's lock decides.
    pid = dead_pid() if names.startswith("a dead") else 1
    contents = json.dumps(dict(what="training", host=socket.gethostname(), pid=pid, started="then"))
    with lock_held_by_child(tmp_path, "training", "training.lock", contents):
        with pytest.raises(DestinationInUse, match=f"is in use by the training process {pid} on host "):
            DestinationLock(tmp_path, "training", "training.lock").acquire()
        assert named(tmp_path / "training.lock")["pid"] == pid  # and nothing of it was touched


def test_a_holder_in_another_pid_namespace_is_honoured(tmp_path):
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-r", "--pid", "--fork", "true"],
                                                         capture_output=True).returncode != 0:
        pytest.skip("needs unshare and user and PID namespaces")
    with lock_held_by_child(tmp_path, "training", "training.lock", prefix=["unshare", "-r", "--pid", "--fork"]):
        assert named(tmp_path / "training.lock")["pid"] == 1  # the holder is process 1 of its own namespace
        with pytest.raises(DestinationInUse, match="is in use by the training process 1 on host "):
            DestinationLock(tmp_path, "training", "training.lock").acquire()


def test_a_killed_holders_lock_is_taken_over_at_once(tmp_path):
    with lock_held_by_child(tmp_path / "out", "generate.py", FOLDER_LOCK) as holder:
        holder.kill()
        holder.wait()
    assert named(tmp_path / "out" / FOLDER_LOCK)["pid"] == holder.pid  # a SIGKILL leaves the file, not the lock
    reports = []
    with hold_destination(tmp_path / "out", "generate.py", FOLDER_LOCK, report=reports.append):
        assert named(tmp_path / "out" / FOLDER_LOCK)["pid"] == os.getpid()
    assert reports == [f"Took over {FOLDER_LOCK} from the generate.py process {holder.pid} on host "
                       f"{socket.gethostname()} (since {reports[0].split('(since ')[1]}"]


# What a damaged or hostile lock file may hold: it never decides, and is never more than one line of a message.
BAD_CONTENTS = {
    "pid a string": json.dumps(dict(what="training", host="h", pid="1234", started="then")),
    "pid 10**23": '{"what": "training", "host": "h", "pid": 100000000000000000000000, "started": "then"}',
    "pid 10**19": json.dumps(dict(what="training", host="h", pid=10**19, started="then")),
    "deeply nested": "[" * 1000 + "]" * 1000,
    "too large": json.dumps(dict(what="training", host="h" * 5000, pid=5, started="then")),
    "a line break in the host": json.dumps(dict(what="training", host="h\nError: forged", pid=5, started="then")),
    "not JSON": "{garbage",
    "a list": "[1, 2]",
}


@pytest.mark.bad_input
@pytest.mark.parametrize("case", BAD_CONTENTS)
def test_a_lock_file_naming_nobody_is_one_line_when_held_and_ignored_when_not(tmp_path, case):
    lock_file = tmp_path / "training.lock"
    with hold_destination(tmp_path, "training", "training.lock"):
        lock_file.write_text(BAD_CONTENTS[case])  # in place: the held file
        with pytest.raises(DestinationInUse) as info:
            DestinationLock(tmp_path, "training", "training.lock").acquire()
    message = str(info.value)
    assert message.startswith(f"{tmp_path} is in use by another process ({lock_file}") and "\n" not in message
    assert message.endswith("; wait for it to end or stop it") and len(message) < 400
    lock_file.write_text(BAD_CONTENTS[case])  # left so by a killed writer: nobody holds it
    reports = []
    with hold_destination(tmp_path, "training", "training.lock", report=reports.append):
        assert named(lock_file)["pid"] == os.getpid()
    assert reports == []


def test_a_locker_that_opened_the_file_its_holder_then_deleted_starts_again(tmp_path, monkeypatch):
    # Its flock on the deleted file succeeds; taking that for the lock would let two writers in.
    first = DestinationLock(tmp_path, "first", FOLDER_LOCK)
    first.acquire()
    opened_before = os.open(first.path, os.O_RDWR)
    first.release()
    with hold_destination(tmp_path, "second", FOLDER_LOCK):
        third = DestinationLock(tmp_path, "third", FOLDER_LOCK)
        real_open, opens = third._open, [opened_before]
        monkeypatch.setattr(third, "_open", lambda: opens.pop() if opens else real_open())
        with pytest.raises(DestinationInUse, match="in use by the second process"):
            third.acquire()
        assert not opens


def test_release_leaves_a_lock_file_that_is_no_longer_its_own(tmp_path):
    lock = DestinationLock(tmp_path, "training", "training.lock")
    lock.acquire()
    (tmp_path / "training.lock").unlink()  # deleted by hand, and taken by another writer since
    with hold_destination(tmp_path, "other", "training.lock"):
        lock.release()
        assert named(tmp_path / "training.lock")["what"] == "other"


def test_a_forked_child_does_not_keep_a_killed_holders_lock(tmp_path):
    # A DataLoader worker forked by a training shares its open files; it must not hold the run after a SIGKILL.
    script = ("import os, signal, sys\nfrom edm2.runtime.locks import DestinationLock\n"
              "DestinationLock(sys.argv[1], 'training', 'training.lock').acquire()\n"
              "child = os.fork()\nif child == 0:\n    signal.pause()\n    os._exit(0)\n"
              "print(child, flush=True)\nsys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    forked = int(holder.stdout.readline())
    try:
        holder.kill()
        holder.wait(timeout=60)
        os.kill(forked, 0)  # the forked child lives on
        with hold_destination(tmp_path, "training", "training.lock"):
            pass
    finally:
        os.kill(forked, signal.SIGKILL)
        holder.stdin.close()
        holder.stdout.close()


@pytest.mark.bad_input
def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    # Followed, the lock would truncate and overwrite whatever file the link names.
    target, out = tmp_path / "precious.txt", tmp_path / "out"
    target.write_text("user data")
    out.mkdir()
    (out / FOLDER_LOCK).symlink_to(target)
    with pytest.raises(OSError):
        DestinationLock(out, "generate.py", FOLDER_LOCK).acquire()
    assert target.read_text() == "user data"


def test_a_filesystem_without_locks_is_an_error_naming_the_lock_file_not_a_refusal(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(locks.fcntl, "flock", no_locks)
    with pytest.raises(OSError) as info:  # DestinationInUse ("in use by another process") is no OSError
        DestinationLock(tmp_path, "training", FOLDER_LOCK).acquire()
    assert info.value.errno == errno.ENOLCK and info.value.filename == str(tmp_path / FOLDER_LOCK)


def test_a_folder_removed_just_before_its_lock_file_is_opened_is_made_again(tmp_path, monkeypatch):
    # A holder that had created the folder removes it on release, right after this locker made sure of it.
    real_open, removed = os.open, []

    def open_after_removal(path, *args):
        if not removed:
            removed.append(path)
            os.rmdir(os.path.dirname(path))
        return real_open(path, *args)

    monkeypatch.setattr(locks.os, "open", open_after_removal)
    lock = DestinationLock(tmp_path / "out", "generate.py", FOLDER_LOCK)
    lock.acquire()
    monkeypatch.undo()
    assert removed and named(tmp_path / "out" / FOLDER_LOCK)["pid"] == os.getpid()
    lock.release()


def test_a_disk_too_full_for_the_holders_name_still_gives_the_lock(tmp_path, monkeypatch):
    # The name only makes a refusal readable; the error that counts is the one naming an output the command writes.
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(locks.os, "pwrite", full)
    with hold_destination(tmp_path, "training", FOLDER_LOCK):
        monkeypatch.undo()
        assert (tmp_path / FOLDER_LOCK).read_bytes() == b""
        with pytest.raises(DestinationInUse, match="in use by another process"):
            DestinationLock(tmp_path, "second", FOLDER_LOCK).acquire()


def test_every_rank_raises_the_main_ranks_refusal(tmp_path, monkeypatch):
    # Rank 1 of a torchrun job: only the main rank locks; its refusal reaches the others by broadcast, so that no
    # rank goes on to write the destination (or to wait at a collective the main rank never reaches).
    refusal = DestinationInUse(f"{tmp_path} is in use by another process")
    monkeypatch.setattr(locks.distributed, "is_main", lambda: False)
    monkeypatch.setattr(locks.distributed, "broadcast_object", lambda obj, *args, **kwargs: refusal)
    with pytest.raises(DestinationInUse) as info:
        with hold_destination(tmp_path, "generate.py", FOLDER_LOCK):
            pytest.fail("a rank entered the block although the main rank was refused")
    assert info.value is refusal and not (tmp_path / FOLDER_LOCK).exists()


def test_a_holder_still_naming_itself_is_named_in_the_refusal(tmp_path, monkeypatch):
    # Between a holder's flock and its name reaching the file, the file is empty: a second writer looking then waits
    # for the name instead of calling the lock file invalid. The holder names itself during the locker's first wait.
    dest = tmp_path / "out.zip"
    holder = DestinationLock(dest, "dataset_tool.py toy")
    holder_fd = os.open(holder.path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(holder_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    name = dict(what="generate.py", host="elsewhere", pid=4321, started="2026-01-02 03:04:05")
    waits = []

    def holder_names_itself(seconds):
        waits.append(seconds)
        if len(waits) == 1:
            holder.path.write_text(json.dumps(name))

    monkeypatch.setattr(locks.time, "sleep", holder_names_itself)
    try:
        with pytest.raises(DestinationInUse, match="in use by the generate.py process 4321 on host elsewhere"):
            DestinationLock(dest, "dataset_tool.py toy").acquire()
    finally:
        os.close(holder_fd)
    assert waits
