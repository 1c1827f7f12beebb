"""Benchmark the metric pipeline's parts: DINOv2 ViT-L/14 features, float64 statistics, Frechet distance.

Example: python scripts/bench_metrics.py --device=cuda --batch=64
The DINOv2 network runs with placeholder weights (speed does not depend on their values); the Inception
TorchScript file cannot be benchmarked without its published weights, so it is left out.
"""

from __future__ import annotations

import time

import click
import numpy as np
import torch

from edm2.eval.benchmark import seconds_per_call
from edm2.eval.detectors import DINOv2ViT
from edm2.eval.metrics import FeatureStats, frechet_distance


@click.command()
@click.option("--device", help="Device to run on", default="cuda" if torch.cuda.is_available() else "cpu",
              show_default=True)
@click.option("--batch", help="Images per DINOv2 batch", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--repeats", help="Timed repetitions", type=click.IntRange(min=1), default=3, show_default=True)
def main(device: str, batch: int, repeats: int) -> None:
    """Print images/s of DINOv2 feature extraction, statistics accumulation time and Frechet distance time."""
    device = torch.device(device)
    net = DINOv2ViT().to(device).eval().requires_grad_(False)
    x = torch.randn(batch, 3, 224, 224, device=device)
    with torch.no_grad():
        seconds = seconds_per_call(lambda: net(x), repeats, 1, device)
    print(f"DINOv2 ViT-L/14 float32, batch {batch} on {device}: {batch / seconds:.1f} images/s")

    for dim in (1024, 2048):
        stats = FeatureStats(dim, device)
        features = torch.randn(batch * 8, dim, device=device)
        seconds = seconds_per_call(lambda: stats.add(features), repeats, 1, device)
        print(f"FeatureStats.add, {dim}-d float64 on {device}: {features.shape[0] / seconds:.0f} images/s")

    rng = np.random.default_rng(0)
    for dim in (1024, 2048):
        a, b = rng.standard_normal((dim, dim + 100)), rng.standard_normal((dim, dim + 100))
        s1, s2 = a @ a.T / dim, b @ b.T / dim
        start = time.perf_counter()  # one call of seconds: Timer would add two untimed ones
        frechet_distance(np.zeros(dim), s1, np.ones(dim), s2)
        print(f"frechet_distance, {dim}-d (scipy sqrtm): {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
