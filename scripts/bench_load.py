"""Training-step speed on a quiet and on a busy CPU, for each OpenMP wait policy, thread count and process count;
then train_edm2.py end to end, with its defaults (a process per core on a CPU), as one process of all cores, and with
glibc's malloc left to hand freed memory back to the kernel (edm2.runtime.host_memory).

Each setting runs in fresh processes (OpenMP reads its wait policy once, when PyTorch loads it), as
training.run.data_parallel_speed measures: one process of some threads, or --processes processes of one thread
each with their gradients all-reduced (`torchrun --nproc_per_node`, which gives each process one thread). "Busy"
starts `--busy` processes that spin on the CPU beside the measured ones, as other users' work or the test suite
would. "default" is the command lines' wait policy (cli.wait_policy: PASSIVE after a short GNU OpenMP spin); "N
processes x 1 thread" is also train_edm2.py's default on an N-core CPU (cli.local_launch). End to end, each run trains
--e2e-duration images of toy-small on 16x16 toy data (dataset_tool.py toy) in a fresh run directory, and its speed is
the mean images/s of its status lines after the first (which holds the start-up).

    python scripts/bench_load.py --preset=toy-small --precision=bf16 --cpu-16bit
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout: use its packages
import cli.wait_policy  # noqa: E402  the command lines' default policy, now in os.environ unless the user set one
import click  # noqa: E402

from training.run.dashboard import read_stats  # noqa: E402

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


def end_to_end(data: Path, duration: str, extra: list[str], env: dict[str, str], precision: str,
               cpu_16bit: bool) -> float:
    """Images/s after the first status line of a fresh `train_edm2.py --preset=toy-small` run on data, with the
    environment the user gave this script and env (the command line chooses its own wait policy and processes)."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, str(REPO / "train_edm2.py"), "--preset=toy-small", f"--data={data}",
                   f"--outdir={tmp}/run", f"--duration={duration}", "--status=1Ki", "--snapshot=0", "--checkpoint=0",
                   "--grid=0", f"--precision={precision}", *(["--cpu-16bit"] if cpu_16bit else []), *extra]
        subprocess.run(command, env={**cli.wait_policy.users_environment(), **env}, check=True,
                       stdout=subprocess.DEVNULL)
        rates = read_stats(Path(tmp) / "run")["images_per_s"][1:]
    return sum(rates) / len(rates)


def toy_data(folder: Path) -> Path:
    """16x16 toy shapes (dataset_tool.py toy) in folder."""
    path = folder / "toy16.zip"
    subprocess.run([sys.executable, str(REPO / "dataset_tool.py"), "toy", "--resolution=16", f"--dest={path}"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


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
@click.option("--e2e-duration", default="6Ki", show_default=True,
              help="Images per end-to-end train_edm2.py run (toy-small, 16x16); 0 = none")
def main(preset: str, resolution: int, batch: int, steps: int, rounds: int, precision: str, cpu_16bit: bool,
         processes: int, busy: int, e2e_duration: str) -> None:
    """Print images/s quiet and loaded for ACTIVE, PASSIVE and the default waiting at 1 and the default threads,
    and for --processes processes of one thread; then train_edm2.py's, with its defaults, as one process and with
    glibc's malloc defaults."""
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
    # (options, environment): MALLOC_TOP_PAD_ at glibc's own default counts as the user's malloc setting, so the
    # command leaves glibc's defaults as they are (edm2.runtime.host_memory).
    e2e = {"train_edm2.py, its defaults": ([], {}), "train_edm2.py --processes=1": (["--processes=1"], {}),
           "train_edm2.py, glibc's malloc defaults": ([], {"MALLOC_TOP_PAD_": str(128 << 10)})}
    if e2e_duration != "0":
        with tempfile.TemporaryDirectory() as tmp:
            data = toy_data(Path(tmp))
            for load in (0, busy):
                with busy_processes(load):
                    for label, (extra, env) in e2e.items():
                        name = f"{label} {'busy' if load else 'quiet'}"
                        results[name] = end_to_end(data, e2e_duration, extra, env, precision, cpu_16bit)
                        print(f"{name:<52} {results[name]:8.1f} images/s", flush=True)
    for label in [*labels.values(), *(e2e if e2e_duration != "0" else ())]:
        quiet, loaded = results[f"{label} quiet"], results[f"{label} busy"]
        print(f"{label}: keeps {loaded / quiet:.0%} of its quiet speed when busy")
    print(json.dumps(dict(settings, processes=processes, busy=busy, images_per_s=results)))


if __name__ == "__main__":
    main()
