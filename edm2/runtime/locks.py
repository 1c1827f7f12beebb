"""One writer per destination: a kernel lock (flock) on a lock file, which no process id or PID namespace fools.

The kernel keeps an flock for as long as the open file that took it, and drops it when its holder ends however it
ends (SIGKILL, a crash); so nothing here ever judges whether a lock is stale, and no process id is ever trusted.
Processes in other PID namespaces (containers with the host's hostname) that share the filesystem meet the same
lock, and on NFS Linux maps flock onto the server's byte-range locks, which the server drops when the client's
lease runs out (NFSv4) or it restarts (NFSv3). (There, as POSIX locks, they bind a process rather than an open
file: a process must not open a lock file it holds a second time, as closing that would let the lock go.)
The lock file's contents (command, host, process, start time) only make the refusal readable; they never decide.

The holder deletes the lock file when it lets go, so a finished writer leaves nothing behind. Deleting a locked
file races with a process that opened it just before: that process would then lock a file no longer in the
folder, while a third one creates and locks a new one. So the holder deletes the file while it still holds the
lock, and a locker checks, once it holds the lock, that the path still names the file it locked (same device and
inode), and starts again if not.

Not filelock: its UnixFileLock leaves the lock file behind on release and writes no holder into it to refuse with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
import weakref
from pathlib import Path
from typing import Callable, Iterator

from edm2.errors import EDM2Error
from edm2.runtime import bounded_json, distributed

FOLDER_LOCK = ".lock"  # a folder destination's lock file, inside it; a file destination's is .NAME.lock beside it
_INFO_BYTES = 4096  # what a holder writes is about 100 bytes
_PID_MAX = 1 << 22  # Linux's PID_MAX_LIMIT
_WAIT_S = 2.0  # a holder names itself right after locking; a file still empty after this is reported as it is


class DestinationInUse(EDM2Error):
    """Another process writes the destination now; the message names it as far as its lock file tells."""


# The locks this process holds. A forked child (a DataLoader worker) shares their open files, and with them the
# locks: it closes its copies, so that the lock ends with its holder, not with the last child of a killed holder.
_HELD: weakref.WeakSet = weakref.WeakSet()


def _let_go_in_child() -> None:
    """In a forked child: close the copies of the parent's lock files (the parent keeps its locks)."""
    for lock in list(_HELD):
        lock.forget()


os.register_at_fork(after_in_child=_let_go_in_child)


class _LookAgain(EDM2Error):
    """A lock file that names nobody yet (its holder is writing it) or was replaced while being locked."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """The process a lock file names: for the refusal's message only."""

    what: str
    host: str
    pid: int
    started: str

    @classmethod
    def this_process(cls, what: str) -> Holder:
        """This process, writing for the command `what`."""
        return cls(what, socket.gethostname(), os.getpid(), time.strftime("%Y-%m-%d %H:%M:%S"))

    def describe(self) -> str:
        """'the WHAT process PID on host HOST (since TIME)'."""
        return f"the {self.what} process {self.pid} on host {self.host} (since {self.started})"


def _parse_holder(raw: bytes, source: str) -> Holder:
    """The holder that a lock file's bytes name; DestinationInUse's reason (an EDM2Error) when they name none."""
    if not raw:
        raise _LookAgain(f"{source} is empty")
    fields = bounded_json.parse(raw, source, max_bytes=_INFO_BYTES)
    if not isinstance(fields, dict):
        raise EDM2Error(f"{source} holds no JSON object")
    texts = [fields.get(name) for name in ("what", "host", "started")]
    # Printable and short: they go into a one-line message.
    if not all(isinstance(text, str) and 0 < len(text) <= 255 and text.isprintable() for text in texts):
        raise EDM2Error(f"{source} names no command, host and start time")
    pid = fields.get("pid")
    if type(pid) is not int or not 0 < pid <= _PID_MAX:
        raise EDM2Error(f"{source} names no process id in [1, {_PID_MAX}]")
    return Holder(*texts[:2], pid, texts[2])


class DestinationLock:
    """The lock of one destination, taken by `acquire` (DestinationInUse when held) and given back by `release`.

    With lock_name the destination is a folder and the lock file lies in it (the folder and its missing parents
    are created, and removed again on release while empty); without, it is .NAME.lock beside the destination.
    """

    def __init__(self, dest: str | os.PathLike, what: str, lock_name: str | None = None):
        self.dest, self.what = Path(dest), what
        self.path = self.dest / lock_name if lock_name else self.dest.parent / f".{self.dest.name}.lock"
        self.created: list[Path] = []
        self._fd: int | None = None

    def acquire(self, report: Callable[[str], None] | None = None) -> None:
        """Take the lock, or raise DestinationInUse; report(line) says when it names a holder that has ended."""
        deadline = time.monotonic() + _WAIT_S
        while not isinstance(fd := self._lock(), int):
            if not isinstance(fd, _LookAgain) or time.monotonic() > deadline:
                raise DestinationInUse(self._in_use(fd))
            time.sleep(0.05)  # its holder is naming itself, or deleted it since we opened it: look again
        self._fd = fd
        _HELD.add(self)
        previous = self._holder(fd)
        # The name is information, not the lock: on a full disk the lock holds with an empty file, and the error
        # that counts is the one naming the output the command fails to write.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(dataclasses.asdict(Holder.this_process(self.what))) + "\n").encode(), 0)
            os.fsync(fd)
        if report is not None and isinstance(previous, Holder):
            report(f"Took over {self.path.name} from {previous.describe()}, which ended.")

    def _lock(self) -> int | Holder | EDM2Error:
        """One try: the locked file's descriptor; else who holds it, or why nobody can be named (its file names
        nobody yet, or it is no longer the file the path names)."""
        replaced = _LookAgain(f"{self.path} was replaced while being locked")
        fd = self._open()
        if fd is None:
            return replaced
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = self._holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise OSError(e.errno, e.strerror, str(self.path)) from None
            return holder
        if self._names(fd):
            return fd
        os.close(fd)
        return replaced

    def release(self) -> None:
        """Delete the lock file (when it is still ours) while holding it, then let go; remove created folders."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if self._names(self._fd):  # not when deleted by hand and taken by another writer since
                self.path.unlink()
        self.forget()
        for folder in reversed(self.created):
            with contextlib.suppress(OSError):  # not empty: it holds results
                folder.rmdir()
        self.created = []

    def forget(self) -> None:
        """Close the lock file without deleting it: this process's hold ends (the lock, if no other has it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        _HELD.discard(self)

    def holder(self) -> Holder | EDM2Error | None:
        """Who holds the lock now, without taking it for longer than one try: None when nobody does (or there is no
        lock file); the holder, or why its lock file names nobody, when somebody does (for --dry-run's report)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            # A shared try, let go at once: it meets a holder's exclusive lock and leaves other lookers alone.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            return self._holder(fd) if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def _open(self) -> int | None:
        """The lock file, opened (created if missing) in its folder (created if missing); None when the folder
        vanished meanwhile (a holder that had created it removed it on release)."""
        for folder in reversed([self.path.parent, *self.path.parent.parents]):
            if not folder.exists():
                with contextlib.suppress(FileExistsError):
                    folder.mkdir()
                    self.created.append(folder)
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except FileNotFoundError:
            return None

    def _names(self, fd: int) -> bool:
        """True when the lock file's path still names the file open as fd."""
        try:
            named, own = os.stat(self.path, follow_symlinks=False), os.fstat(fd)
        except FileNotFoundError:
            return False
        return (named.st_dev, named.st_ino) == (own.st_dev, own.st_ino)

    def _holder(self, fd: int) -> Holder | EDM2Error:
        """Who the open lock file names, or why it names nobody."""
        try:
            return _parse_holder(os.pread(fd, _INFO_BYTES + 1, 0), str(self.path))
        except EDM2Error as e:
            return e
        except OSError as e:
            return EDM2Error(f"{self.path}: {e.strerror}")

    def _in_use(self, holder: Holder | EDM2Error) -> str:
        """The refusal: who writes the destination, as far as the lock file tells."""
        if isinstance(holder, Holder):
            return f"{self.dest} is in use by {holder.describe()}; wait for it to end or stop it"
        return f"{self.dest} is in use by another process ({holder}); wait for it to end or stop it"


@contextlib.contextmanager
def hold_destination(dest: str | os.PathLike, what: str, lock_name: str | None = None,
                     report: Callable[[str], None] | None = None) -> Iterator[DestinationLock | None]:
    """Hold dest's lock (DestinationLock) for the block on the main rank; every rank raises DestinationInUse
    when another process holds it. Call it inside distributed.session(), where the ranks are known."""
    lock, error = None, None
    if distributed.is_main():
        lock = DestinationLock(dest, what, lock_name)
        try:
            lock.acquire(report)
        except (EDM2Error, OSError) as e:
            error = e
    error = distributed.broadcast_object(error)
    if error is not None:
        raise error
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
