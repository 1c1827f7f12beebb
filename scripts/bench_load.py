"""Training-step speed on a quiet and on a busy CPU, for each OpenMP wait policy, thread count and process count.

Each setting runs in fresh processes (OpenMP reads its wait policy once, when PyTorch loads it), as
training.run.data_parallel_speed measures: one process of some threads, or --processes processes of one thread
each with their gradients all-reduced (`torchrun --nproc_per_node`, which gives each process one thread). "Busy"
starts `--busy` processes that spin on the CPU beside the measured ones, as other users' work or the test suite
would. "default" is the command lines' wait policy (cli.wait_policy: PASSIVE after a short GNU OpenMP spin).

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: use its packages
import cli.wait_policy  # noqa: E402, F401  the command lines' default policy, now in os.environ unless the user set one
import click  # noqa: E402

from training.run.data_parallel_speed import data_parallel_speed  # noqa: E402

POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
DEFAULT_POLICY = {name: os.environ[name] for name in POLICY_VARIABLES if name in os.environ}


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


def measure(policy: str | None, processes: int, threads: int | None, **settings) -> float:
    """Images/s of one setting in fresh processes; policy None: the command lines' default (cli.wait_policy);
    threads None: PyTorch's default."""
    for name in (*POLICY_VARIABLES, "OMP_NUM_THREADS"):
        os.environ.pop(name, None)
    os.environ.update({"OMP_WAIT_POLICY": policy} if policy else DEFAULT_POLICY)
    return data_parallel_speed(processes=processes, threads=threads, **settings).images_per_s


@click.command()
@click.option("--preset", default="toy-small", show_default=True)
@click.option("--resolution", type=click.IntRange(min=8), default=32, show_default=True)
@click.option("--batch", type=int, default=32, show_default=True)
@click.option("--steps", type=int, default=2, show_default=True, help="Timed steps per round")
@click.option("--rounds", type=int, default=2, show_default=True, help="Rounds; the best counts")
@click.option("--precision", default="bf16", show_default=True)
@click.option("--cpu-16bit/--no-cpu-16bit", default=True, show_default=True)
@click.option("--processes", type=click.IntRange(min=2), default=os.cpu_count() or 2, show_default="the CPUs",
              help="Processes of one thread in the data-parallel setting")
@click.option("--busy", type=int, default=2, show_default=True, help="Spinning processes beside the loaded runs")
def main(preset: str, resolution: int, batch: int, steps: int, rounds: int, precision: str, cpu_16bit: bool,
         processes: int, busy: int) -> None:
    """Print images/s quiet and loaded for ACTIVE, PASSIVE and the default waiting at 1 and the default threads,
    and for --processes processes of one thread."""
    settings = dict(preset=preset, resolution=resolution, batch=batch, steps=steps, rounds=rounds,
                    precision=precision, cpu_16bit=cpu_16bit)
    cases = [("ACTIVE", 1, None), ("ACTIVE", 1, 1), ("PASSIVE", 1, 1), ("PASSIVE", 1, None), (None, 1, 1),
             (None, 1, None), (None, processes, 1)]
    labels = {case: f"{case[0] or 'default'} {case[1]} process(es) x {case[2] or 'default'} thread(s)"
              for case in cases}
    results = {}
    for load in (0, busy):
        with busy_processes(load):
            for case in cases:
                name = f"{labels[case]} {'busy' if load else 'quiet'}"
                results[name] = measure(*case, **settings)
                print(f"{name:<52} {results[name]:8.1f} images/s", flush=True)
    for label in labels.values():
        quiet, loaded = results[f"{label} quiet"], results[f"{label} busy"]
        print(f"{label}: keeps {loaded / quiet:.0%} of its quiet speed when busy")
    print(json.dumps(dict(settings, processes=processes, busy=busy, images_per_s=results)))


if __name__ == "__main__":
    main()
