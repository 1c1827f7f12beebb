"""Training-step speed on a quiet and on a busy CPU, for each OpenMP wait policy and thread count.

Each setting runs in a fresh process (OpenMP reads its wait policy once, when PyTorch loads it). "Busy" starts
`--busy` processes that spin on the CPU beside the measured one, as other users' work or the test suite would.
"default" is the command lines' wait policy (cli.wait_policy: PASSIVE after a short GNU OpenMP spin) with PyTorch's
threads.

    python scripts/bench_load.py --preset=toy-small --precision=bf16 --cpu-16bit
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import click

REPO = Path(__file__).resolve().parent.parent
# One measured setting: build the preset's step on synthetic data, warm up, time `steps` steps; print images/s.
MEASURE = """
import sys
sys.path.insert(0, {repo!r})
import cli.wait_policy  # the command lines' default where OMP_WAIT_POLICY is not set
import time, torch
from training.run.benchmark import synthetic_step
from training.step import training_step
step = synthetic_step({preset!r}, {batch}, torch.device("cpu"), precision={precision!r}, cpu_16bit={cpu_16bit})
for _ in range(2):
    float(training_step(step))
started = time.perf_counter()
for _ in range({steps}):
    loss = training_step(step)
float(loss)
print({batch} * {steps} / (time.perf_counter() - started))
"""


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """`count` processes spinning on the CPU for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def measure(policy: str | None, threads: int | None, **settings) -> float:
    """Images/s of one setting in a fresh process; policy None: the command lines' default (cli.wait_policy)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    else:
        env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", MEASURE.format(repo=str(REPO), **settings)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


@click.command()
@click.option("--preset", default="toy-small", show_default=True)
@click.option("--batch", type=int, default=32, show_default=True)
@click.option("--steps", type=int, default=6, show_default=True)
@click.option("--precision", default="bf16", show_default=True)
@click.option("--cpu-16bit/--no-cpu-16bit", default=True, show_default=True)
@click.option("--busy", type=int, default=2, show_default=True, help="Spinning processes beside the loaded runs")
def main(preset: str, batch: int, steps: int, precision: str, cpu_16bit: bool, busy: int) -> None:
    """Print images/s quiet and loaded for ACTIVE, PASSIVE and the default waiting at 1 and the default threads."""
    settings = dict(preset=preset, batch=batch, steps=steps, precision=precision, cpu_16bit=cpu_16bit)
    cases = [("ACTIVE", None), ("ACTIVE", 1), ("PASSIVE", 1), ("PASSIVE", None), (None, 1), (None, None)]
    results = {}
    labels = {case: f"{case[0] or 'default'} threads={case[1] or 'default'}" for case in cases}
    for load in (0, busy):
        with busy_processes(load):
            for policy, threads in cases:
                name = f"{labels[policy, threads]} {'busy' if load else 'quiet'}"
                results[name] = measure(policy, threads, **settings)
                print(f"{name:<36} {results[name]:8.1f} images/s", flush=True)
    for label in labels.values():
        quiet, loaded = results[f"{label} quiet"], results[f"{label} busy"]
        print(f"{label}: keeps {loaded / quiet:.0%} of its quiet speed when busy")
    print(json.dumps(dict(settings, busy=busy, images_per_s=results)))


if __name__ == "__main__":
    main()
