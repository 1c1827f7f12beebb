"""--processes: a command line that starts its own ranks on this machine, as `torchrun --standalone` would, and
watches them.

On a CPU the ranks are processes of one thread each by default. The threads of one process meet at the end of every
operator, so when another program takes a core every operator waits for the thread that lost it; processes meet
once per step, in the gradients' all-reduce. Toy-small bf16 on 2 cores of a Xeon beside two busy processes
(scripts/bench_load.py): end to end through train_edm2.py, one process of two threads kept 29% of its quiet speed and
two processes of one thread 70%; quiet, the two processes were 18% faster.

The launcher validates nothing itself: the command has checked its options before it calls run_ranks, and each
rank runs the same command line under torchrun's environment. The ranks run in a process group of their own, so
that a signal reaches each of them once, from the launcher: SIGINT, SIGTERM and SIGHUP are forwarded. A rank whose
launcher dies (SIGKILL, the OOM killer) receives SIGTERM from the kernel (Linux), finishes its step and writes a
training state, so nothing is left running. When a rank fails, the others are stopped at once and the launcher
exits with the failed rank's status.

Not torchrun (elastic_launch): its ranks get no PR_SET_PDEATHSIG, so a killed launcher leaves them running, and a
failed rank ends torchrun with status 1 and ChildFailedError's traceback.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import click
import torch

from cli import wait_policy
from cli.command import ARGS, LAUNCHER_ENV, LOST_PEER_STATUS
from edm2.runtime import distributed
from edm2.runtime.limits import MAX_DEFAULT_PROCESSES
from training.run.sample_grid import GENERATE_THREADS_ENV, generate_threads
from training.run.signals import die_by

FORWARDED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_POLL_S = 0.05
_LOST_PEER_GRACE_S = 60  # how long the ranks that lost their group wait for the failed one to end and say why


def cores() -> int:
    """The CPU cores this process may run on (its affinity mask, which a scheduler's allocation sets)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_processes(fits: Callable[[int], bool], threads: int | None = None) -> int:
    """The ranks a CPU run starts unless told: one per core (per `threads` cores, when given), at most
    MAX_DEFAULT_PROCESSES, and the most of those that fits(processes) accepts (a batch that splits over them)."""
    most = max(1, min(cores() // (threads or 1), MAX_DEFAULT_PROCESSES))
    return max(count for count in range(1, most + 1) if count == 1 or fits(count))


def processes(given: int | None, threads: int | None, fits: Callable[[int], bool]) -> int:
    """The processes a command trains as: the launcher's where one started this process (torchrun, or relaunch),
    else `given` (--processes), else one on CUDA and on a CPU default_processes for `threads` (--threads, else
    OMP_NUM_THREADS where set)."""
    if distributed.launched():
        return distributed.launched_world_size()
    if given:
        return given
    if torch.cuda.is_available():
        return 1
    set_threads = os.environ.get("OMP_NUM_THREADS", "")
    return default_processes(fits, threads or (int(set_threads) if set_threads.isdigit() else None))


def note(given: int | None, count: int, lead: str) -> str:
    """How many processes a run starts on this machine and who chose that: a line for its start."""
    why = "--processes" if given else ("the default on a CPU: one per core; processes of one thread keep their speed "
                                       "beside other work far better than one process of many threads; --processes "
                                       "changes it")
    return f"{lead} {count} processes on this machine ({why}); the first reports for all."


def relaunch(script: str, count: int, given: int | None, threads: int | None, lead: str) -> int:
    """Say so (note, after lead), then run the current command line again as `count` ranks of `python script` with
    its arguments as given (cli.command.ARGS), each with `threads` threads or the cores shared out (run_ranks);
    their exit status."""
    click.echo(note(given, count, lead), err=True)
    command = [sys.executable, str(Path(script).resolve()), *click.get_current_context().meta[ARGS]]
    return run_ranks(command, count, threads or default_threads(count))


def default_threads(processes: int) -> int:
    """Threads per rank when the user gave none: the cores shared out among the ranks, at least one each."""
    return max(1, cores() // processes)


def launched_here() -> bool:
    """Whether this process is a rank that run_ranks started."""
    return LAUNCHER_ENV in os.environ


def follow_launcher() -> None:
    """In a rank run_ranks started: receive SIGTERM (finish the step, write a training state, end) when the
    launcher dies, and end at once if it died before this process could ask for that. Elsewhere, nothing."""
    if not launched_here():
        return
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(os.environ[LAUNCHER_ENV]):
        sys.exit(f"Error: the process that started this one ({os.environ[LAUNCHER_ENV]}) has ended")


def _rank_environment(rank: int, processes: int, port: int, threads: int) -> dict[str, str]:
    """The environment torchrun --standalone gives rank `rank` of `processes` on this machine, with `threads` CPU
    threads, this launcher's process id, and the threads of a plain generate.py, which the sample grids use."""
    return {**wait_policy.users_environment(), **distributed.local_launch_environment(rank, processes, port),
            "OMP_NUM_THREADS": str(threads), LAUNCHER_ENV: str(os.getpid()),
            GENERATE_THREADS_ENV: str(generate_threads())}


def _status(code: int) -> int:
    """A child's return code as a shell reports it: a signal's death is 128 + its number."""
    return code if code >= 0 else 128 - code


def run_ranks(command: list[str], processes: int, threads: int) -> int:
    """Run `processes` ranks of `command` (an argv: the same command line, which must not start ranks again under
    torchrun's environment) with `threads` threads each, forwarding signals, until all have ended; returns the exit
    status: the first failed rank's, else 0. When the ranks ended by a SIGINT forwarded to them, this process ends by
    SIGINT too, as each of them did."""
    port = distributed.free_port()
    received: list[int] = []
    ranks: list[subprocess.Popen] = []

    def forward(signum: int, _frame) -> None:
        received.append(signum)
        for rank in ranks:
            if rank.poll() is None:
                rank.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        for rank in range(processes):
            ranks.append(subprocess.Popen(command, env=_rank_environment(rank, processes, port, threads),
                                          start_new_session=True))
        failed = _wait(ranks, received)
    finally:
        for rank in ranks:  # only where this process itself failed before the ranks ended
            if rank.poll() is None:
                rank.kill()
                rank.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failed is not None:
        if failed.returncode < 0:  # a rank that a signal killed said nothing itself
            print(f"Error: process {ranks.index(failed)} of {processes} was killed by "
                  f"{signal.Signals(-failed.returncode).name}; the others were stopped", file=sys.stderr, flush=True)
        elif failed.returncode == LOST_PEER_STATUS:  # every rank that failed only lost the others
            print(f"Error: process {ranks.index(failed)} of {processes} lost the others of its group, and none of "
                  "them said why", file=sys.stderr, flush=True)
        return _status(failed.returncode)
    if any(rank.returncode == -signal.SIGINT for rank in ranks):
        die_by(signal.SIGINT)
    return 0


def _failed(rank: subprocess.Popen, received: list[int]) -> bool:
    """Whether a rank that ended failed: a non-zero status, other than death by a signal forwarded to it."""
    return rank.returncode != 0 and -rank.returncode not in received


def _wait(ranks: list[subprocess.Popen], received: list[int]) -> subprocess.Popen | None:
    """Wait for every rank to end; returns the first that failed, or None. Once one has failed the others are
    killed at once, unless a signal was forwarded: then each is stopping on its own, rank 0 perhaps still writing
    its training state. A rank that only lost its group (LOST_PEER_STATUS) is no cause: the rank that failed is
    ending and may still be printing why, so it is waited for (_LOST_PEER_GRACE_S at most)."""
    failed, lost_since = None, None
    while any(rank.poll() is None for rank in ranks):
        if failed is None:
            ended = [rank for rank in ranks if rank.returncode is not None]
            failed = _first_failure(ended, received)
            if failed is not None and not received:
                _kill_running(ranks)
            lost = [rank for rank in ended if rank.returncode == LOST_PEER_STATUS]
            if failed is None and lost and lost_since is None:
                lost_since = time.monotonic()
            elif failed is None and lost and time.monotonic() - lost_since > _LOST_PEER_GRACE_S:
                _kill_running(ranks)
                failed = lost[0]
        time.sleep(_POLL_S)
    return failed or _first_failure(ranks, received) or next(
        (rank for rank in ranks if rank.returncode == LOST_PEER_STATUS), None)


def _kill_running(ranks: list[subprocess.Popen]) -> None:
    """Kill the ranks that are still running."""
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()


def _first_failure(ended: list[subprocess.Popen], received: list[int]) -> subprocess.Popen | None:
    """The failed rank among ranks that ended since the last look, one that only lost its group aside: one a signal
    killed (the OOM killer, say) before one that failed on its own; then the lowest rank."""
    failed = [rank for rank in ended if _failed(rank, received) and rank.returncode != LOST_PEER_STATUS]
    return min(failed, key=lambda rank: rank.returncode >= 0, default=None)
