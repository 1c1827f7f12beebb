"""Training throughput (images/s) of a preset at a precision, on synthetic data, with the loop's own step."""

from __future__ import annotations

import time

import click
import numpy as np
import torch

from edm2 import distributed
from edm2.encoders import StabilityVAEEncoder, StandardRGBEncoder
from edm2.loss import EDM2Loss
from training.options import PRECISIONS, TrainingOptions
from training.outputs import max_memory_gb
from training.presets import PRESETS
from training.state import TrainingState
from training.step import TrainingStep, training_step


def synthetic_batches(batch: int, channels: int, resolution: int, label_dim: int, latents: bool):
    """Endless (images, labels) batches shaped like the preset's dataset."""
    rng = np.random.default_rng(0)
    if latents:  # mean/std latents as a dataset stores them
        images = torch.cat([torch.randn(batch, channels // 2, resolution, resolution) * 4,
                            torch.rand(batch, channels // 2, resolution, resolution) * 0.1], dim=1)
    else:
        images = torch.from_numpy(rng.integers(0, 256, (batch, channels, resolution, resolution), dtype=np.uint8))
    labels = torch.eye(label_dim)[rng.integers(0, label_dim, batch)] if label_dim else torch.zeros(batch, 0)
    while True:
        yield images, labels


@click.command()
@click.option("--preset", type=click.Choice(list(PRESETS)), default="toy-small", show_default=True)
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp16", show_default=True)
@click.option("--batch-gpu", type=click.IntRange(min=1), help="Images per round  [default: the preset's batch, at most 64]")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True, help="Accumulation rounds per step")
@click.option("--resolution", type=click.IntRange(min=8), help="Data resolution  [default: 64, toy presets 16]")
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True, help="Timed optimizer steps")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed steps first")
def main(preset: str, precision: str, batch_gpu: int | None, rounds: int, resolution: int | None, steps: int,
         warmup: int) -> None:
    """Time full training steps (loss, backward, Adam, EMA) on one device and print images/s.

    \b
    Examples:
      python scripts/bench_train.py --preset=toy-small --precision=fp32
      python scripts/bench_train.py --preset=edm2-img512-s --precision=bf16 --batch-gpu=64
    """
    device = distributed.device()
    release = preset.startswith("edm2-")
    latents = preset.startswith("edm2-img512")
    data_channels = 8 if latents else 3
    resolution = resolution or (64 if release else 16)
    label_dim = 1000 if release else 6
    encoder = StabilityVAEEncoder() if latents else StandardRGBEncoder()
    batch_gpu = batch_gpu or min(PRESETS[preset].batch, 64)
    # One process: a step of batch_gpu x rounds images, with the preset's learning-rate schedule for that batch.
    opts = TrainingOptions.from_preset(
        preset, dataset=dict(resolution=resolution, num_channels=data_channels, label_dim=label_dim),
        encoder=encoder.config(), precision=precision, batch=batch_gpu * rounds,
    )
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True

    state = TrainingState.create(opts, encoder.out_channels(data_channels), device)
    state.cur_nimg = 10 * opts.batch  # past the start, where the learning rate is 0
    step = TrainingStep(
        state=state, loss_fn=EDM2Loss(opts.P_mean, opts.P_std, state.net.sigma_data), encoder=encoder,
        batches=synthetic_batches(batch_gpu, data_channels, resolution, label_dim, latents), opts=opts,
        rounds=rounds, device=device,
    )
    click.echo(f"{preset}: {resolution}x{resolution}x{data_channels} data, {opts.batch} images per step, "
               f"precision {precision} (computing in {state.net.compute_dtype(device)}) on {device}, "
               f"{torch.get_num_threads()} CPU thread(s)")

    for i in range(warmup + steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        training_step(step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    images_per_s = steps * opts.batch / seconds
    click.echo(f"{images_per_s:.1f} images/s  ({1000 / images_per_s:.2f} sec/kimg, "
               f"{seconds / steps * 1000:.1f} ms/step, max memory {max_memory_gb(device):.2f} GB)")


if __name__ == "__main__":
    main()
