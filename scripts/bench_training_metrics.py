"""Benchmark the cost of train_edm2.py --metrics as a share of training time at a preset's snapshot interval.

Example: python scripts/bench_training_metrics.py --preset=toy-small --num=2000
         python scripts/bench_training_metrics.py --preset=edm2-img512-s --device=cuda --batch-gpu=64

On one device: the loop's own training step on synthetic data shaped like the preset's (training.run.benchmark),
and the default sampler (32 Heun steps, 63 network evaluations) on the preset's network with batches of the same
size (edm2.eval.benchmark). The share is (num / sampling images/s) / (snapshot interval / training images/s): the
same on N devices, which split both. Left out, each small beside generation: the detector's pass (Inception:
~6 GFLOPs per image against 63 x the network's), the VAE decoder of latent presets, loading the snapshot.
"""

from __future__ import annotations

import click
import torch

from edm2.eval import benchmark
from training.presets import PRESETS
from training.run.benchmark import preset_network, synthetic_step
from training.step import training_step


@click.command()
@click.option("--preset", type=click.Choice(list(PRESETS)), default="toy-small", show_default=True)
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu", show_default=True)
@click.option("--batch-gpu", type=click.IntRange(min=1), default=32, show_default=True,
              help="Images per training round and sampling batch")
@click.option("--num", type=click.IntRange(min=1), default=2000, show_default=True, help="--metrics-num")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True, help="Timed training steps")
def main(preset: str, device: str, batch_gpu: int, num: int, steps: int) -> None:
    """Print training images/s, sampling images/s, one evaluation's seconds and its share of training time."""
    device = torch.device(device)
    step = synthetic_step(preset, batch_gpu, device)
    train_ips = batch_gpu / benchmark.seconds_per_call(lambda: training_step(step), steps, 1, device)
    net = preset_network(preset).to(device).eval()
    sample_ips = benchmark.sampling_images_per_s(net, None, 1.0, batch_gpu, 32, 1, device)
    interval = PRESETS[preset].snapshot
    evaluation, training = num / sample_ips, interval / train_ips
    click.echo(f"{preset} on {device}: training {train_ips:.1f} img/s, sampling {sample_ips:.2f} img/s; one "
               f"evaluation of {num} images takes {evaluation:.1f} s per {interval} training images "
               f"({training:.1f} s): {100 * evaluation / training:.1f}% of training time")


if __name__ == "__main__":
    main()
