"""Benchmark the cost of train_edm2.py --metrics as a share of training time at a preset's snapshot interval.

Example: python scripts/bench_training_metrics.py --preset=toy-small --num=2000
         python scripts/bench_training_metrics.py --preset=edm2-img512-s --device=cuda --batch-gpu=32

The preset's network with random weights at its data shape (img512: 64x64x4 latents, img64: 64x64x3, toy: 16x16x3)
is timed on one device: a training round (forward and backward of Eq. 21's loss at the batch per device) and a
sampling batch (the default sampler, 32 Heun steps, 63 network evaluations). The share is
  (num / sampling images/s) / (snapshot interval / training images/s).
Left out, each small beside generation: the detector's pass over the images (Inception: ~6 GFLOPs per image against
63 x the network's), the VAE decoder of latent presets, loading the snapshot, the statistics.
"""

from __future__ import annotations

import time

import click
import torch

from edm2.loss import EDM2Loss
from edm2.networks import Precond
from edm2.sampler import edm_sampler
from training.presets import PRESETS, get_preset

SHAPES = {"edm2-img512": (64, 4), "edm2-img64": (64, 3), "toy": (16, 3)}  # resolution, channels of the data


def timed(fn, repeats: int, device: torch.device) -> float:
    """Seconds per call of fn, after one warm-up call."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


@click.command()
@click.option("--preset", type=click.Choice(list(PRESETS)), default="toy-small", show_default=True)
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu", show_default=True)
@click.option("--batch-gpu", type=click.IntRange(min=1), default=32, show_default=True,
              help="Images per training round and sampling batch")
@click.option("--num", type=click.IntRange(min=1), default=2000, show_default=True, help="--metrics-num")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
def main(preset: str, device: str, batch_gpu: int, num: int, repeats: int) -> None:
    """Print training images/s, sampling images/s, one evaluation's seconds and its share of training time."""
    device, recipe = torch.device(device), get_preset(preset)
    resolution, channels = next(shape for prefix, shape in SHAPES.items() if preset.startswith(prefix))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    net = Precond(resolution, channels, 1000 if preset.startswith("edm2") else 0, model_channels=recipe.channels,
                  dropout=recipe.dropout, **recipe.network).to(device)
    labels = torch.eye(net.label_dim, device=device)[torch.arange(batch_gpu) % net.label_dim] if net.label_dim else None
    images = torch.randn([batch_gpu, channels, resolution, resolution], device=device)
    loss = EDM2Loss(recipe.P_mean, recipe.P_std)

    def train_round() -> None:
        with torch.autocast(device.type, dtype, enabled=device.type == "cuda"):
            loss(net, images, labels).sum().backward()

    def sample_batch() -> None:
        with torch.no_grad(), torch.autocast(device.type, dtype, enabled=device.type == "cuda"):
            edm_sampler(net, torch.randn_like(images), labels)

    train_ips = batch_gpu / timed(train_round, repeats, device)
    sample_ips = batch_gpu / timed(sample_batch, max(1, repeats // 3), device)
    evaluation = num / sample_ips
    interval = recipe.snapshot / train_ips
    click.echo(f"{preset} on {device}: training {train_ips:.1f} img/s, sampling {sample_ips:.2f} img/s; one "
               f"evaluation of {num} images {evaluation:.1f} s per {recipe.snapshot} training images "
               f"({interval:.1f} s): {100 * evaluation / interval:.1f}% of training time (one device)")


if __name__ == "__main__":
    main()
