"""Benchmark the EDM sampler: images/s of a small EDM2 network at 32 steps, with and without guidance."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: use its edm2, not an installed one
from edm2.networks import Precond
from edm2.generation import seeded_inputs
from edm2.sampler import edm_sampler


def images_per_second(net, gnet, guidance, batch_size, num_steps, repeats, device) -> float:
    """Best-of-`repeats` throughput of edm_sampler on one batch, including per-seed noise generation."""
    best = float("inf")
    for r in range(repeats + 1):  # the first round warms up kernels and caches
        seeds = range(r * batch_size, (r + 1) * batch_size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        noise, labels, randn_like = seeded_inputs(seeds, net.img_channels, net.img_resolution, net.label_dim, device=device)
        with torch.no_grad():
            edm_sampler(net, noise, labels, gnet=gnet, guidance=guidance, num_steps=num_steps, randn_like=randn_like)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if r > 0:
            best = min(best, time.perf_counter() - start)
    return batch_size / best


@click.command(epilog="""\b
Example:
  python scripts/bench_sampler.py --resolution=16 --channels=32 --batch=8
""")
@click.option("--resolution", type=click.IntRange(min=4), default=16, show_default=True, help="Image resolution")
@click.option("--img_channels", type=click.IntRange(min=1), default=4, show_default=True, help="Image channels")
@click.option("--channels", type=click.IntRange(min=8), default=32, show_default=True, help="model_channels of the main net")
@click.option("--gnet_channels", type=click.IntRange(min=8), default=None, help="model_channels of the unconditional guiding net [default: same]")
@click.option("--classes", type=click.IntRange(min=0), default=1000, show_default=True, help="label_dim of the main net")
@click.option("--batch", "batch_size", type=click.IntRange(min=1), default=8, show_default=True, help="Images per batch")
@click.option("--steps", "num_steps", type=click.IntRange(min=2), default=32, show_default=True, help="Sampling steps")
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True, help="Timed batches (best is reported)")
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu", show_default=True, help="torch device")
def main(resolution, img_channels, channels, gnet_channels, classes, batch_size, num_steps, repeats, device):
    """Print images/s for the sampler without and with guidance (2 x 31 + 1 = 63 evaluations per net)."""
    device = torch.device(device)
    arch = dict(channel_mult=[1, 2, 2], num_blocks=2, attn_resolutions=[resolution // 4], channels_per_head=16)
    torch.manual_seed(0)
    net = Precond(resolution, img_channels, classes, model_channels=channels, **arch).eval().requires_grad_(False).to(device)
    gnet = Precond(resolution, img_channels, 0, model_channels=gnet_channels or channels, **arch)
    gnet = gnet.eval().requires_grad_(False).to(device)
    print(f"device {device}, {resolution}x{resolution}x{img_channels}, model_channels {channels}, batch {batch_size}, {num_steps} steps")
    for label, g, w in (("no guidance", None, 1.0), ("guidance 1.4", gnet, 1.4)):
        rate = images_per_second(net, g, w, batch_size, num_steps, repeats, device)
        print(f"{label:>13}: {rate:8.2f} images/s")


if __name__ == "__main__":
    main()
