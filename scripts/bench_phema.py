"""Benchmark reconstruct_phema.py: wall time and peak memory for 8 and 32 profiles from 64 snapshots.

Peak memory is the child process's maximum resident set size from os.wait4 (getrusage ru_maxrss):
it sees everything the process touched, including PyTorch's own allocator, which tracemalloc (Python
allocations only) would miss. Each configuration runs in a fresh process so peaks do not mix, and a
process that only imports the tool gives the baseline (Python + PyTorch) to subtract.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from edm2.formats.snapshot import save_network, snapshot_name  # noqa: E402
from edm2.networks import Precond, count_parameters  # noqa: E402
from edm2.phema import PowerFunctionEMA  # noqa: E402


def write_snapshots(run_dir: Path, net: Precond, num_times: int, images_per_snapshot: int) -> None:
    """Two EMA tracks per snapshot time, from a random walk of the weights, as our snapshot files."""
    ema = PowerFunctionEMA(net)
    for k in range(1, num_times + 1):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
        nimg = k * images_per_snapshot
        ema.update(cur_nimg=nimg, batch_size=images_per_snapshot)
        for track, std in ema.get():
            save_network(run_dir / snapshot_name("network-snapshot", nimg, std), track,
                         {"nimg": nimg, "ema_std": std})


def run_child(args: list[str], threads: int | None) -> tuple[float, float]:
    """Run a Python child; return its wall time (s) and peak resident memory (MiB)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    # A whole child process, timed with its peak memory (wait4's rusage): not a callable in this process.
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise click.ClickException(f"child failed with exit code {proc.returncode}: {' '.join(args)}")
    return time.perf_counter() - start, usage.ru_maxrss / 1024  # Linux reports KiB


@click.command()
@click.option("--channels", type=click.IntRange(min=16), default=32, show_default=True, help="model_channels of the net")
@click.option("--snapshots", type=click.IntRange(min=2), default=64, show_default=True, help="Input snapshot files (2 per time)")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="OMP_NUM_THREADS for the reconstruction  [default: PyTorch's choice]")
@click.option("--tmpdir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Where to write the snapshots")
def main(channels: int, snapshots: int, threads: int | None, tmpdir: Path | None):
    """Time post-hoc reconstruction of 8 and 32 profiles from SNAPSHOTS files of an img512-shaped net.

    \b
    Example: python scripts/bench_phema.py --channels=32 --snapshots=64
    """
    torch.manual_seed(0)
    net = Precond(64, 4, 1000, model_channels=channels)
    params = count_parameters(net)
    with tempfile.TemporaryDirectory(dir=tmpdir) as tmp:
        run_dir = Path(tmp) / "run"
        write_snapshots(run_dir, net, snapshots // 2, 8 << 20)
        size = sum(p.stat().st_size for p in run_dir.iterdir()) / 2**20
        print(f"net: model_channels={channels}, {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MiB float32); "
              f"{snapshots} snapshots, {size:.0f} MiB on disk; OMP_NUM_THREADS={threads or 'unset'}")
        base_s, base_mib = run_child(["-c", "import reconstruct_phema"], threads)
        print(f"baseline (import only): {base_s:.1f} s, peak RSS {base_mib:.0f} MiB")
        print("profiles  --batch  passes  wall s  minus import s  peak RSS MiB  above baseline MiB")
        for profiles, batch in [(8, 8), (32, 8), (32, 32)]:
            stds = [f"{0.02 + 0.2 * i / (profiles - 1):.4f}" for i in range(profiles)]
            out_dir = Path(tmp) / f"out-{profiles}-{batch}"
            wall, mib = run_child(["reconstruct_phema.py", f"--indir={run_dir}", f"--outdir={out_dir}",
                                   f"--std={','.join(stds)}", f"--batch={batch}"], threads)
            assert len(list(out_dir.iterdir())) == profiles
            passes = -(-profiles // batch)
            print(f"{profiles:8d}  {batch:7d}  {passes:6d}  {wall:6.1f}  {wall - base_s:14.1f}  {mib:12.0f}  {mib - base_mib:17.0f}")


if __name__ == "__main__":
    main()
