"""One training per run directory: a lock file, created atomically, that names the host and process holding it.

O_CREAT | O_EXCL is atomic on local filesystems and on NFS v3 and later, so of two trainings started at once
exactly one creates the lock. A lock whose holder is known to be gone (same host, and its process id no
longer runs or now belongs to a process started later, or the host rebooted since) is removed; a lock held
on another host cannot be checked from here and is honoured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

from edm2 import files
from edm2.errors import EDM2Error

LOCK_FILE = "training.lock"
BREAK_SUFFIX = ".break"  # held while one process removes a stale lock, so two never remove a fresh one
_STARTING_S = 10.0  # a lock this young without contents belongs to a process still writing it
_ATTEMPTS = 50


class RunLocked(EDM2Error):
    """Another training holds the run directory."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (/proc/PID/stat field 22); None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class Holder:
    """The process a lock names."""

    host: str
    pid: int
    boot_id: str = ""
    start_ticks: int | None = None
    started: str = ""

    @classmethod
    def this_process(cls) -> Holder:
        """This process, as its lock names it."""
        pid = os.getpid()
        return cls(socket.gethostname(), pid, _boot_id(), _start_ticks(pid), time.strftime("%Y-%m-%d %H:%M:%S"))

    def is_gone(self) -> bool:
        """True when the holder ran on this host and is known to have ended; False when alive or unknowable."""
        if self.host != socket.gethostname():
            return False
        if self.boot_id and _boot_id() and self.boot_id != _boot_id():
            return True  # the host rebooted since
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # a process of another user has that id: alive, unless it started later
            pass
        now = _start_ticks(self.pid)
        return self.start_ticks is not None and now is not None and now != self.start_ticks

    def describe(self) -> str:
        """'process PID on host HOST (since TIME)'."""
        return f"process {self.pid} on host {self.host}" + (f" (since {self.started})" if self.started else "")


def _parse_holder(contents: bytes) -> Holder | None:
    """The holder a lock file's contents name; None when they name none (empty, torn or foreign)."""
    try:
        fields = json.loads(contents)
        return Holder(**{f.name: fields[f.name] for f in dataclasses.fields(Holder) if f.name in fields})
    except (ValueError, TypeError, KeyError):
        return None


class RunLock:
    """The lock of one run directory; `acquire` takes it or raises RunLocked, `release` gives it back."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self.holder: Holder | None = None

    def acquire(self, report: Callable[[str], None] = print) -> None:
        """Take the lock; remove a stale one first (and report it); RunLocked when another process holds it."""
        me = Holder.this_process()
        for _ in range(_ATTEMPTS):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._remove_if_stale(report)
                continue
            try:
                os.write(fd, (json.dumps(dataclasses.asdict(me)) + "\n").encode())
                os.fsync(fd)
            except OSError:
                os.close(fd)
                self.path.unlink(missing_ok=True)
                raise
            os.close(fd)
            files.fsync_path(self.path.parent)
            self.holder = me
            return
        raise RunLocked(f"{self.path.parent}: could not take {LOCK_FILE} in {_ATTEMPTS} attempts; try again")

    def _remove_if_stale(self, report: Callable[[str], None]) -> None:
        """Remove the existing lock if its holder is gone; RunLocked when it is held."""
        try:
            contents, age_s = self.path.read_bytes(), time.time() - self.path.stat().st_mtime
        except FileNotFoundError:  # released meanwhile
            return
        holder = _parse_holder(contents)
        if holder is None and age_s < _STARTING_S:
            time.sleep(0.1)  # its creator is still writing it
            return
        if holder is not None and not holder.is_gone():
            raise RunLocked(self._held_message(holder))
        guard = self.path.with_name(LOCK_FILE + BREAK_SUFFIX)
        try:
            guard_fd = os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):
                if time.time() - guard.stat().st_mtime > 60:  # its remover was killed in the act
                    guard.unlink()
            time.sleep(0.1)
            return
        try:
            if self.path.read_bytes() == contents:  # still the stale lock, not a new one
                self.path.unlink()
                report(f"Removed the stale lock of {holder.describe() if holder else 'a process'}, which ended.")
        except FileNotFoundError:
            pass
        finally:
            os.close(guard_fd)
            guard.unlink(missing_ok=True)

    def _held_message(self, holder: Holder) -> str:
        where = f"{self.path.parent} is in use by the training {holder.describe()}"
        if holder.host == socket.gethostname():
            return f"{where}; wait for it to end or stop it"
        return f"{where}; if that training is no longer running (its host went down), delete {self.path}"

    def release(self) -> None:
        """Delete the lock file if it is still this process's."""
        with contextlib.suppress(FileNotFoundError):
            if self.holder is not None and _parse_holder(self.path.read_bytes()) == self.holder:
                self.path.unlink()
        self.holder = None
