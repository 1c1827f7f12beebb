"""Interruption: SIGTERM and SIGINT end a run after the current step with a training state written.

SIGTERM (cluster preemption) may come more than once: SLURM signals every process of a job step, torchrun
forwards the one it receives to each worker, and a preempted job gets another at the end of its grace time;
every SIGTERM after the first is ignored. A second SIGINT (Ctrl-C pressed again) aborts at once. After a
stop by SIGINT the command line ends by SIGINT itself (die_by), so shells, scripts and make stop too.

A job script that requeues a stopped training (scripts/slurm/train_edm2.sbatch) must tell such a stop from a
training that failed or finished: with $EDM2_STOP_MARKER set, every process that stopped on a signal after its
training state was written writes that file (write_stop_marker), and no other ending does.
"""

from __future__ import annotations

import os
import signal
import sys

from edm2.runtime import distributed, files

STOP_MARKER_ENV = "EDM2_STOP_MARKER"


class StopFlag:
    """Set by SIGINT/SIGTERM while active; all_set() agrees across ranks."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal: signal.Signals | None = None
        self._group = distributed.cpu_group()
        self._previous = {}

    def __enter__(self) -> StopFlag:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame) -> None:
        if self.signal is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signal = signal.Signals(signum)
        if distributed.is_main():  # every rank receives it (a launcher forwards it to each): one line says so
            print(f"Received {self.signal.name}: finishing this step and writing a checkpoint.", flush=True)

    def all_set(self) -> bool:
        """True when any rank was signalled (a collective call: every rank must make it)."""
        return distributed.any_rank(self.signal is not None, group=self._group)


def die_by(sig: signal.Signals) -> None:
    """End this process by sig with its default action, as if it had never been caught (a shell then sees
    'killed by SIGINT' and stops a script, where exit status 0 would let it carry on)."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    sys.exit(128 + sig)  # only where the signal is blocked: the status a shell reports for it


def write_stop_marker(nimg: int) -> None:
    """Write the file $EDM2_STOP_MARKER names (when set): this process stopped on a signal at nimg images, its
    training state written. A marker that cannot be written is one line: the job then does not requeue."""
    path = os.environ.get(STOP_MARKER_ENV)
    if not path:
        return
    try:
        with files.atomic_path(path) as tmp:
            tmp.write_text(f"stopped at {nimg} images with a training state\n")
    except OSError as e:
        print(f"Cannot write the stop marker {path} (${STOP_MARKER_ENV}): {e.strerror or e}", flush=True)
