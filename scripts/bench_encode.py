"""Benchmark `dataset_tool.py encode`: images/s with a tiny AutoencoderKL at several batch sizes.

Usage: python scripts/bench_encode.py --num=256 --resolution=64 --batches=1,8,32
"""

import shutil
import sys
import tempfile
import time
from pathlib import Path

import click
import torch
from click.testing import CliRunner
from diffusers import AutoencoderKL

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dataset_tool  # noqa: E402  (the repository root is put on the path just above)


def invoke(*args) -> None:
    """Run a dataset_tool command in this process; stop on failure."""
    result = CliRunner().invoke(dataset_tool.main, [str(arg) for arg in args])
    if result.exit_code != 0:
        raise click.ClickException(f"dataset_tool {args[0]} failed: {result.output.strip()}")


@click.command()
@click.option("--num", default=256, show_default=True, help="Images to encode per measurement.")
@click.option("--resolution", default=64, show_default=True, help="Image size.")
@click.option("--batches", default="1,8,32", show_default=True, help="Comma-separated --batch values.")
@click.option("--workers", default=2, show_default=True, help="encode --workers.")
@click.option("--threads", default=0, help="torch CPU threads (0 = torch's default).")
def main(num: int, resolution: int, batches: str, workers: int, threads: int) -> None:
    """Time encode (reading PNGs, the VAE, writing files and the ZIP) on a toy dataset."""
    if threads:
        torch.set_num_threads(threads)
    root = Path(tempfile.mkdtemp(prefix="bench-encode-"))
    try:
        torch.manual_seed(0)
        # Two levels (2x downsampling), 8/16 channels: far smaller than the real 4-level VAE.
        AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                      up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, norm_num_groups=8,
                      latent_channels=4).save_pretrained(root / "vae")
        invoke("toy", "--dest", root / "toy.zip", "--resolution", resolution, "--num", num)
        device = "cuda" if torch.cuda.is_available() else f"cpu, {torch.get_num_threads()} threads"
        click.echo(f"encode of {num} images {resolution}x{resolution}, tiny VAE, {workers} workers, {device}")
        for batch in [int(b) for b in batches.split(",")]:
            dest = root / f"out-{batch}.zip"
            # One run of the whole encode command per batch size (files, workers, ZIP), not a repeated callable.
            start = time.perf_counter()
            invoke("encode", "--source", root / "toy.zip", "--dest", dest, "--vae", root / "vae",
                   "--batch", batch, "--workers", workers)
            seconds = time.perf_counter() - start
            click.echo(f"batch {batch:4d}: {num / seconds:8.1f} images/s ({seconds:.2f} s)")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
