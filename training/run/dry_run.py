"""What a training would do, for --dry-run: a blend's shares, the network's size, where the run would start or
resume, and on request its speed from a few timed steps."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from edm2.data.blend import BlendDataset
from edm2.networks import count_parameters
from edm2.runtime import distributed
from edm2.runtime.locks import Holder
from edm2.runtime.utilization import peak_tflops, utilization
from training.run import checkpoint
from training.run.benchmark import group_images_per_s
from training.data_order import data_loader, order_for
from training.options import TrainingOptions, rounds_per_step
from training.run.outputs import hms
from training.run.run_dir import LOCK_FILE, RunLock
from training.state import TrainingState, init_network, training_flops
from training.step import WARMUP_STEPS, TrainingStep, data_parallel, training_step

if TYPE_CHECKING:
    from edm2.data.dataset import ImageData, ImageFolderDataset
    from edm2.encoders import Encoder


def blend_shares(dataset: ImageData) -> str | None:
    """For a blend, the line the training prints when it starts: each source's share of a blend epoch; else None."""
    return dataset.describe() if isinstance(dataset, BlendDataset) else None


def parameter_count(opts: TrainingOptions, img_channels: int) -> int:
    """Trainable parameters of the network the options describe, built on the meta device (no memory, no time)."""
    with torch.device("meta"):
        return count_parameters(init_network(opts, img_channels))


def newest_state(run_dir: str | os.PathLike) -> tuple[str | None, int]:
    """The newest training state's path in run_dir and its image count; (None, 0) when there is none."""
    states = checkpoint.list_states(run_dir)
    if not states:
        return None, 0
    match = checkpoint.STATE_PATTERN.match(states[0].name)
    return str(states[0]), checkpoint.tagged_images(match[1], match[2])


def start_or_resume(run_dir: str | os.PathLike, duration: int) -> str:
    """Where a training in run_dir would begin: a new run, or the newest training state found there; and, when a
    live training holds the run directory's lock, that a training started now would be refused, and by whom."""
    path, images = newest_state(run_dir)
    if path is None:
        where = f"Would start a new run in {run_dir} (no training state there)."
    elif images >= duration:
        where = f"Would stop at once: {path} already holds {images} >= {duration} images."
    else:
        where = (f"Would resume from {path} at {images} of {duration} images (the newest training state; a "
                 "damaged one falls back to the one before).")
    holder = RunLock(run_dir).holder()
    if holder is None:
        return where
    named = holder.describe() if isinstance(holder, Holder) else f"another process ({holder})"
    return (f"{where} But {run_dir} is in use now: {named} holds {LOCK_FILE}; a training started now is refused "
            "until it ends.")


def timed_speed(opts: TrainingOptions, dataset: ImageFolderDataset, encoder: Encoder, steps: int) -> str:
    """Images/s of `steps` training steps of a fresh network, after WARMUP_STEPS warm-up steps (start-up, compiling),
    by this process or, in a process group (torchrun, --processes), by all of them together as the run would train;
    and the time the rest of the run would take at that speed; nothing is written."""
    device, rank, world_size = distributed.device(), distributed.get_rank(), distributed.get_world_size()
    batch_gpu, rounds = rounds_per_step(opts.batch, opts.batch_gpu, world_size)
    state = TrainingState.create(opts, encoder.out_channels(dataset.num_channels), device)
    model = data_parallel(state.net, world_size, device)  # as training.run.loop trains
    order = order_for(dataset, opts.seed, rank, world_size, batch_gpu, 0)
    step = TrainingStep.of_run(state, opts, encoder, iter(data_loader(dataset, order, opts.workers, device)),
                               device=device, rounds=rounds, model=model, rank=rank)
    for _ in range(WARMUP_STEPS):
        float(training_step(step))  # float(): waits for the device
    rate = group_images_per_s(step, steps, opts.batch)
    remaining = max(opts.duration - newest_state(opts.run_dir)[1], 0)
    peak, source = peak_tflops(device, state.net.compute_dtype(device), opts.peak_tflops)
    speed = utilization(training_flops(opts, state.net.img_channels), rate, peak, world_size)
    each = "" if world_size == 1 else f"{world_size} x "
    mfu = "" if speed["mfu"] is None else f", MFU {speed['mfu']:.1%} of {each}{peak:.4g} TFLOP/s ({source})"
    who = f"one {device.type} process" if world_size == 1 else f"{world_size} {device.type} processes"
    return (f"Timed {steps} step(s) of {opts.batch} images on {who} after {WARMUP_STEPS} warm-up steps: "
            f"{rate:.1f} images/s, {speed['tflops']:.3g} TFLOP/s{mfu}; the {remaining} images to go would take "
            f"about {hms(remaining / rate)}.")
