"""Benchmark `dataset_tool.py convert` from a webdataset tar into shards: seconds for one-sample shards (one shard
write per sample, the case where a tar read anew from its first member per shard costs quadratic time) and for one
shard of every sample.

Usage: python scripts/bench_tar.py --nums=500,2000 --resolution=32
"""

import io
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import PIL.Image
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dataset_tool  # noqa: E402  (the repository root is put on the path just above)


def write_tar(path: Path, num: int, resolution: int) -> None:
    """A tar of num random PNGs in img2dataset's layout (KEY.png, KEY.cls)."""
    rng = np.random.default_rng(0)
    with tarfile.open(path, "w") as tar:
        for i in range(num):
            buffer = io.BytesIO()
            PIL.Image.fromarray(rng.integers(0, 256, (resolution, resolution, 3), dtype=np.uint8)).save(buffer, "png")
            for ext, data in (("png", buffer.getvalue()), ("cls", str(i % 3).encode())):
                member = tarfile.TarInfo(f"{i:08d}.{ext}")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))


def seconds_to_convert(source: Path, dest: Path, shard_size: int) -> float:
    """Wall-clock seconds of one convert into shards of shard_size samples; stop on failure."""
    start = time.perf_counter()
    result = CliRunner().invoke(dataset_tool.main, ["convert", "--source", str(source), "--dest", str(dest),
                                                    "--shard-size", str(shard_size)])
    if result.exit_code != 0:
        raise click.ClickException(f"convert failed: {result.output.strip()}")
    return time.perf_counter() - start


@click.command()
@click.option("--nums", default="500,2000", show_default=True, help="Comma-separated sample counts.")
@click.option("--resolution", default=32, show_default=True, help="Image size.")
def main(nums: str, resolution: int) -> None:
    """Print seconds per convert of a tar of each count: into one-sample shards, and into one shard."""
    root = Path(tempfile.mkdtemp(prefix="bench-tar-"))
    try:
        for num in (int(n) for n in nums.split(",")):
            source = root / f"{num}.tar"
            write_tar(source, num, resolution)
            one = seconds_to_convert(source, root / f"{num}-one.shards", 1)
            whole = seconds_to_convert(source, root / f"{num}-whole.shards", num)
            click.echo(f"{num} samples of {resolution}x{resolution}: {one:.1f} s into {num} one-sample shards, "
                       f"{whole:.1f} s into one shard")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
