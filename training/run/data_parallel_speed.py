"""The training step as `torchrun --nproc_per_node=N` runs it on a CPU, measured: N processes of a few threads each
(torchrun's default is one), each computing batch / N images, gradients averaged by Gloo's DistributedDataParallel
as in training/run/loop.py (scripts/bench_release.py, scripts/bench_load.py).

On a CPU shared with other work the toy presets' steps hold up far better over processes than over threads: each
process's operators run without an OpenMP barrier between them, and the processes meet once per step, in the
all-reduce. Toy-small bf16 at 32x32, batch 32, on 2 cores of a Xeon with AMX (scripts/bench_load.py): one process of
two threads 95.8 images/s quiet and 16.6 beside two busy processes, two processes of one thread 107.1 and 50.7.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.multiprocessing as mp

from edm2.runtime import distributed, host_memory
from training.run.benchmark import group_images_per_s, synthetic_step
from training.run.checkpoint import weights_digest
from training.step import WARMUP_STEPS, data_parallel, training_step


@dataclasses.dataclass(frozen=True)
class DataParallelSpeed:
    """What the processes measured: images/s of all of them together, and each rank's weights' digest after the
    last step (equal on every rank: they trained one model)."""

    images_per_s: float
    digests: tuple[str, ...]


def _worker(rank: int, port: int, results, preset: str, batch: int, processes: int, threads: int | None, steps: int,
            warmup: int, rounds: int, options: dict) -> None:
    """One rank: join the group as torchrun's environment describes it, keep freed memory as train_edm2.py's ranks
    do, warm up, time `rounds` windows of `steps` steps between barriers, report (rank, best images/s of all ranks
    together, digest)."""
    distributed.describe_local_launch(rank, processes, port)
    host_memory.keep_freed_memory()
    if threads:
        torch.set_num_threads(threads)
    with distributed.session():
        step = synthetic_step(preset, batch // processes, torch.device("cpu"), **options)
        model = data_parallel(step.state.net, processes, torch.device("cpu"))
        step = dataclasses.replace(step, rank=rank, model=model)
        for _ in range(warmup):
            float(training_step(step))
        best = max(group_images_per_s(step, steps, batch) for _ in range(rounds))
        results.put((rank, best, weights_digest(step.state.net)))


def data_parallel_speed(preset: str, batch: int, processes: int, threads: int | None = 1, steps: int = 4,
                        warmup: int = WARMUP_STEPS, rounds: int = 3, **options) -> DataParallelSpeed:
    """Images/s of `preset`'s training step at `batch` images over `processes` CPU processes of `threads` threads
    (None: PyTorch's default, under the OpenMP settings of os.environ, which the processes inherit), the best of
    `rounds` windows of `steps` steps after `warmup` untimed ones (which compile, where options compile), keeping
    freed memory as the command lines do (edm2.runtime.host_memory); options are synthetic_step's (resolution,
    precision, cpu_16bit, compile, channels_last, ...)."""
    if batch % processes:
        raise ValueError(f"batch {batch} does not split over {processes} processes")
    results = mp.get_context("spawn").SimpleQueue()
    args = (distributed.free_port(), results, preset, batch, processes, threads, steps, warmup, rounds, options)
    mp.start_processes(_worker, args=args, nprocs=processes, join=True, start_method="spawn")
    reports = sorted(results.get() for _ in range(processes))
    return DataParallelSpeed(images_per_s=reports[0][1], digests=tuple(digest for _, _, digest in reports))
