"""The speed options shared by the sampling command lines (generate.py, calculate_metrics.py gen), and --threads
shared by every command line that computes."""

from __future__ import annotations

import functools
import os
from typing import Callable

import click
import torch

from cli import local_launch, wait_policy
from edm2.networks import Precond
from edm2.runtime import distributed, host_memory
from edm2.runtime.limits import MAX_THREADS
from edm2.runtime.speed import PRECISIONS, SamplingSpeed
from edm2.sampler import SELF

OPTIONS = ("compile_", "channels_last", "precision", "cpu_16bit")


def sampling_speed_options(fn: Callable) -> Callable:
    """Add --compile, --channels-last, --precision and --cpu-16bit; fn receives them as one `speed` argument."""

    @functools.wraps(fn)
    def wrapper(**kwargs):
        compile_, channels_last, precision, cpu_16bit = (kwargs.pop(name) for name in OPTIONS)
        speed = SamplingSpeed(compile=compile_, channels_last=channels_last, precision=precision, cpu_16bit=cpu_16bit)
        return fn(speed=speed, **kwargs)

    options = [
        click.option("--compile/--no-compile", "compile_", default=None,
                     help="torch.compile the networks  [default: on CUDA only]"),
        click.option("--channels-last/--no-channels-last", default=None,
                     help="Channels-last (NHWC) convolutions  [default: on CUDA only]"),
        click.option("--precision", type=click.Choice(PRECISIONS),
                     help="Network activations on CUDA  [default: the snapshot's; fp16 for the release's networks]"),
        click.option("--cpu-16bit", is_flag=True, help="Compute in --precision on the CPU too (use bf16), not float32"),
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def apply_speed(speed: SamplingSpeed, net: Precond, gnet: Precond | str | None,
                device: torch.device) -> tuple[Precond, Precond | str | None]:
    """(net, gnet) set up to sample at speed; a gnet that is no network of its own (None, or SELF: net guides
    itself) stays as it is."""
    return speed.apply(net, device), (gnet if gnet in (None, SELF) else speed.apply(gnet, device))


THREADS = "threads"


def _set_threads(ctx: click.Context, param: click.Parameter, threads: int | None) -> None:
    """Limit PyTorch's CPU threads (OpenMP included) and keep freed host memory for reuse (host_memory) before the
    command computes anything; the thread count stays in ctx.meta[THREADS] for a command that records it
    (train_edm2.py, in its options)."""
    ctx.meta[THREADS] = threads
    host_memory.keep_freed_memory()
    if threads is not None:
        torch.set_num_threads(threads)


def threads_note(starting: int = 1) -> str:
    """The CPU threads in force and who chose them, the OpenMP wait policy and what becomes of freed host memory: a
    line for the start of a run; with starting > 1, those of the processes this command is about to start
    (cli.local_launch). A single process of several threads on a CPU is told that as many processes of one thread
    hold up under load."""
    given = click.get_current_context().meta.get(THREADS)
    if starting > 1:
        processes, threads = starting, given or local_launch.default_threads(starting)
    else:
        processes, threads = distributed.launched_world_size(), torch.get_num_threads()
    if given is not None:
        why = "--threads"
    elif starting > 1 or local_launch.launched_here():
        why = "this machine's cores shared out among the processes; --threads changes it"
    elif "OMP_NUM_THREADS" in os.environ:
        why = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}" + (", as torchrun sets it" if processes > 1 else "")
    else:
        why = "PyTorch's default: one per core; --threads changes it"
    line = f"CPU threads: {threads} per process ({why}); {wait_policy.describe()}; {host_memory.describe()}."
    if threads > 1 and processes == 1 and not torch.cuda.is_available():
        # The threads of one process wait for each other at every operator; processes meet once a step
        # (cli.local_launch).
        line += (f" On a CPU shared with other work, {threads} processes of one thread each keep far more of their "
                 f"speed than one process of {threads} threads: --processes={threads} --threads=1")
    return line


# On a machine shared with other processes, OpenMP threads that spin waiting for each other can make a step
# several times slower (bfloat16 on 2 busy cores: 8x slower with two threads than with one).
threads_option = click.option(
    "--threads", type=click.IntRange(min=1, max=MAX_THREADS), expose_value=False, callback=_set_threads,
    help="CPU threads per process for PyTorch (OpenMP)  [default: PyTorch's, one per core]; 1 is often fastest "
         "on a machine busy with other work",
)
