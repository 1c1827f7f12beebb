"""One training per run directory: edm2.runtime.locks's kernel lock on RUN/training.lock, which names the host and
process holding it and is free again the moment that process ends (no lock is ever judged stale by its process id)."""

from __future__ import annotations

import os

from edm2.runtime.locks import DestinationLock

LOCK_FILE = "training.lock"


class RunLock(DestinationLock):
    """The lock of one run directory; `acquire` takes it or raises edm2.runtime.locks.DestinationInUse, `release`
    gives it back (and deletes training.lock)."""

    def __init__(self, run_dir: str | os.PathLike):
        super().__init__(run_dir, "training", LOCK_FILE)
