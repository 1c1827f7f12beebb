"""Peak memory of `calculate_metrics.py sweep` against the number of EMA lengths (issue 11: about 1 + batch networks).

Writes a run of a large random network (EMA snapshots at four times, two tracks each, with the metadata training
writes) and a few 8x8 images, then sweeps the validation loss over 1, 4 and 16 lengths, each in its own process,
and reports each process's peak resident memory, also in units of one float32 network. Example:

    python scripts/bench_sweep.py --channels=128 --ema-batch=4
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import numpy as np
import PIL.Image
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from edm2.encoders import StandardRGBEncoder  # noqa: E402
from edm2.formats.snapshot import save_network, snapshot_name  # noqa: E402
from edm2.networks import Precond, count_parameters  # noqa: E402

CHILD = """
import resource, runpy, sys
sys.argv = ["calculate_metrics.py", "sweep", *sys.argv[1:]]
try:
    runpy.run_path("calculate_metrics.py", run_name="__main__")
except SystemExit as e:
    if e.code:
        raise
# VmHWM is this program's own peak; ru_maxrss would start at the parent's, which Linux carries across exec.
try:
    with open("/proc/self/status") as status:
        print("PEAK_KB", next(line.split()[1] for line in status if line.startswith("VmHWM:")))
except OSError:
    print("PEAK_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def write_run(folder: Path, channels: int) -> int:
    """EMA snapshots of a random network at 4 times x sigma_rel 0.05, 0.10, and 8 images; returns the net's bytes."""
    torch.manual_seed(0)
    net = Precond(8, 3, 0, model_channels=channels, channel_mult=(1, 2, 3, 4), num_blocks=2, attn_resolutions=(2,))
    for k in range(1, 5):
        for std in (0.05, 0.10):
            with torch.no_grad():
                for p in net.parameters():
                    p.normal_()
            meta = dict(nimg=k * 1024, ema_std=std, encoder=StandardRGBEncoder().config(),
                        loss=dict(P_mean=-0.8, P_std=1.6))
            save_network(folder / "run" / snapshot_name("network-snapshot", k * 1024, std), net, meta)
    data = folder / "data"
    data.mkdir()
    for i in range(8):
        PIL.Image.fromarray(np.random.default_rng(i).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(data / f"{i}.png")
    (data / "dataset.json").write_text(json.dumps({"labels": None}))
    return 4 * count_parameters(net)


@click.command()
@click.option("--channels", type=click.IntRange(min=16), default=128, show_default=True, help="model_channels")
@click.option("--ema-batch", type=click.IntRange(min=1), default=4, show_default=True, help="sweep --ema-batch")
def main(channels: int, ema_batch: int) -> None:
    """Report the sweep's peak memory for 1, 4 and 16 EMA lengths, in networks above the process's own."""
    with tempfile.TemporaryDirectory() as tmp:
        net_bytes = write_run(Path(tmp), channels)
        # The same process with nothing loaded (the command's --help): Python, torch and the command's imports.
        base = peak_rss(["--help"])
        print(f"network: {net_bytes / 2**20:.0f} MiB in float32; --ema-batch={ema_batch}; the process alone: "
              f"{base / 2**30:.2f} GiB", flush=True)
        rows = []
        for count in (1, 4, 16):
            stds = ",".join(f"{s:.3f}" for s in np.linspace(0.02, 0.2, count))
            peak = peak_rss([f"--indir={tmp}/run", f"--std={stds}", "--metrics=loss", f"--data={tmp}/data",
                             "--num=2", f"--dest={tmp}/out{count}", f"--ema-batch={ema_batch}"])
            above = (peak - base) / net_bytes
            print(f"{count:2d} EMA lengths: peak RSS {peak / 2**30:.2f} GiB, {above:.1f} networks above the process "
                  f"alone", flush=True)
            rows.append(dict(stds=count, peak_rss_gb=peak / 2**30, networks=above))
        print(json.dumps(dict(network_mb=net_bytes / 2**20, ema_batch=ema_batch, base_rss_gb=base / 2**30,
                              sweeps=rows)))


def peak_rss(args: list[str]) -> int:
    """Peak resident bytes of `calculate_metrics.py sweep ARGS` run in its own process."""
    out = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        raise click.ClickException(out.stdout[-2000:] + out.stderr[-2000:])
    return int(out.stdout.split("PEAK_KB")[-1]) * 1024


if __name__ == "__main__":
    main()
