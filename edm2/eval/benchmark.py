"""Measuring speed: device-synchronized timing, and the sampler's images/s with the FLOPs behind them (their TFLOP/s
and MFU: edm2.runtime.utilization, as training reports them).

A FLOP count here is edm2.runtime.utilization.forward_flops's, 2 per multiply-accumulate, the convention of MFU
(Table 6's "gigaflops" count a multiply-accumulate as one operation and add the elementwise ones: edm2.eval.flops).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.utils.benchmark

from edm2.networks import Precond
from edm2.procedures.generation import seeded_inputs
from edm2.runtime.utilization import forward_flops
from edm2.sampler import edm_sampler
from edm2.solvers import evaluations


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], calls: int, warmup: int, device: torch.device) -> float:
    """Mean wall time of fn() over `calls` calls after `warmup` untimed ones (and Timer's own two or more), at this
    process's thread count, the device's queue drained before the clock starts and before it stops."""
    for _ in range(warmup):
        fn()

    def clock() -> float:
        synchronize(device)
        return time.perf_counter()

    timer = torch.utils.benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads(), timer=clock)
    return timer.timeit(calls).mean


def sampling_flops_per_image(net: Precond, gnet: Precond | None, num_steps: int, solver: str = "heun") -> float:
    """FLOPs to sample one image: forward_flops of every evaluation of net (and of gnet when guiding), as many as the
    solver's record says (edm2.solvers.evaluations)."""
    flops = forward_flops(net) + (forward_flops(gnet) if gnet is not None else 0)
    return float(flops) * evaluations(solver, num_steps)


def sampling_images_per_s(net: Precond, gnet: Precond | None, guidance: float, batch_size: int, num_steps: int,
                          repeats: int, device: torch.device, solver: str = "heun") -> float:
    """Best-of-`repeats` images/s of edm_sampler on one batch, including the per-seed noise; an untimed first
    batch warms up kernels, caches and compiled graphs."""
    # Not torch.utils.benchmark.Timer: each repeat samples new seeds, and Timer.timeit runs two untimed calls before
    # each measurement, two more batches of sampling per repeat.
    best = float("inf")
    for r in range(repeats + 1):
        seeds = range(r * batch_size, (r + 1) * batch_size)
        synchronize(device)
        start = time.perf_counter()
        noise, labels, randn_like = seeded_inputs(seeds, net.img_channels, net.img_resolution, net.label_dim,
                                                  device=device)
        with torch.no_grad():
            edm_sampler(net, noise, labels, gnet=gnet, guidance=guidance, num_steps=num_steps, randn_like=randn_like,
                        solver=solver)
        synchronize(device)
        if r > 0:
            best = min(best, time.perf_counter() - start)
    return batch_size / best
