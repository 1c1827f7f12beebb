"""Loader memory per process and throughput per CPU core: a release-layout ZIP against a shard dataset.

Memory: synthetic datasets of tiny samples (1x4x4 uint8, labeled: memory is about counts, not pixels) of each
--counts size, as a ZIP (one PNG per sample plus dataset.json, the release's layout) and as shards. Each is opened
in a fresh process that reads --batches batches of 256 through the training loader (training.data_order: the
DataOrder and a DataLoader with 2 workers); then the USS (pages no other process shares) and the anonymous memory
(the process's own heap: what cannot be dropped as page cache) of the main process and each worker are read from
/proc/PID/smaps_rollup, with Private_Dirty (pages a worker copied from the main process or wrote) and the main
process's heap growth from opening the dataset to the end (main_growth_mib). USS also counts library pages that
no other process maps at that moment, which varies with what else runs on a shared machine; Private_Dirty and
the heap growth do not. The baseline row is a process that imported everything but opened no dataset.

Throughput: samples per CPU second read by one process (torch and OpenMP on one thread, no workers)
in the training order, batches of 64, for 8x64x64 float32 latents (.npy in the ZIP) and 3x64x64 uint8 images (PNG
in the ZIP), against the training speed of EDM2-S at 512x512 (8x64x64 latents): 4717 images/s on 32 A100 GPUs
in the paper's Table 3, about 147 per GPU. Example:

    python scripts/bench_loader.py --counts=100000,1000000,10000000 --zip-counts=100000,1000000 \\
        --out=bench-loader.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import click
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
GPU_IMAGES_PER_S = 4717 / 32  # EDM2-S img512 training speed per A100 (paper, Table 3)


def make_zip(path: Path, count: int, sample: bytes, suffix: str) -> None:
    """A release-layout ZIP of count copies of one sample file, with dataset.json labels."""
    from edm2.data.dataset import image_fname, latent_fname
    from edm2.data.dataset_writer import labels_json, write_zip_member
    name = image_fname if suffix == ".png" else latent_fname
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        labels = {}
        for i in range(count):
            write_zip_member(archive, name(i), sample)
            labels[name(i)] = i % 10
        write_zip_member(archive, "dataset.json", labels_json(labels))


def make_shards(path: Path, count: int, sample: np.ndarray, encoding: str) -> None:
    """A shard dataset of count copies of one sample, labeled."""
    from edm2.data import shard_writer
    index = shard_writer.new_index(encoding, list(sample.shape), 10, count, {"bench": count},
                                   shard_size=min(count, 1 << 20))

    def fill(_k: int, first: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        return np.broadcast_to(sample, (n, *sample.shape)), np.arange(first, first + n) % 10
    shard_writer.write_shards(path, index, fill)


def rollup(pid: int) -> dict:
    """USS and anonymous memory of a process in MiB, from /proc/PID/smaps_rollup."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":")
        fields[key] = int(value.split()[0]) / 1024
    return {"uss_mib": round(fields["Private_Clean"] + fields["Private_Dirty"], 1),
            "private_dirty_mib": round(fields["Private_Dirty"], 1), "anon_mib": round(fields["Anonymous"], 1)}


def memory_child(path: str, batches: int) -> None:
    """Open path (or nothing for ''), read batches through the training loader, print the memory as JSON."""
    import torch
    from edm2.data.sources import open_data
    from training.data_order import data_loader, order_for
    torch.set_num_threads(1)
    if not path:
        print(json.dumps({"main": rollup(os.getpid()), "workers": [], "open_s": 0}))
        return
    # Opening a dataset happens once per process: one call, timed with the memory it adds.
    before, started = rollup(os.getpid()), time.perf_counter()
    dataset = open_data(path)
    opened = time.perf_counter() - started
    loader = iter(data_loader(dataset, order_for(dataset, 0, 0, 1, 256, 0), 2, torch.device("cpu")))
    for _ in range(batches):
        next(loader)
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
    workers = [rollup(int(pid)) for pid in children]
    main = rollup(os.getpid())
    print(json.dumps({"main": main, "workers": workers, "open_s": round(opened, 2),
                      "main_growth_mib": round(main["anon_mib"] - before["anon_mib"], 1)}))


def measure_memory(path: str, batches: int) -> dict:
    from edm2.runtime import bounded_json

    out = subprocess.run([sys.executable, __file__, "child", path, str(batches)], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)
    return bounded_json.parse(out.stdout.splitlines()[-1], "the measuring process's output")


def throughput(path: str, samples: int) -> float:
    """Samples per CPU second (this process's user + system time: on a shared machine wall time also counts
    the waits for a core) that one process reads in the training order."""
    import torch
    from edm2.data.sources import open_data
    from training.data_order import data_loader, order_for
    torch.set_num_threads(1)
    dataset = open_data(path)
    loader = iter(data_loader(dataset, order_for(dataset, 0, 0, 1, 64, 0), 0, torch.device("cpu")))
    next(loader)  # warm-up: the first files opened, the page cache filled by make_*
    started = time.process_time()
    for _ in range(samples // 64):
        next(loader)
    return samples // 64 * 64 / (time.process_time() - started)


def tiny_png() -> bytes:
    from edm2.data.dataset_writer import png_bytes
    return png_bytes(np.zeros((4, 4), np.uint8))


def memory_table(root: Path, counts: list[int], zip_counts: list[int], batches: int) -> list[dict]:
    rows = [dict(format="baseline", count=0, **measure_memory("", batches))]
    for count in counts:
        shards = root / f"m{count}.shards"
        make_shards(shards, count, np.zeros((1, 4, 4), np.uint8), "pixels")
        rows.append(dict(format="shards", count=count, **measure_memory(str(shards), batches)))
        click.echo(json.dumps(rows[-1]), err=True)
        os.system(f"rm -rf {shards}")
        if count in zip_counts:
            zipped = root / f"m{count}.zip"
            make_zip(zipped, count, tiny_png(), ".png")
            rows.append(dict(format="zip", count=count, **measure_memory(str(zipped), batches)))
            click.echo(json.dumps(rows[-1]), err=True)
            zipped.unlink()
    return rows


def throughput_table(root: Path, count: int, samples: int) -> list[dict]:
    from edm2.data.dataset_writer import npy_bytes, png_bytes
    rng = np.random.default_rng(0)
    latent = rng.standard_normal((8, 64, 64)).astype(np.float32)
    image = rng.integers(0, 256, (3, 64, 64), dtype=np.uint8)
    rows = []
    for kind, sample, encoding, member, suffix in [
            ("latents 8x64x64 float32", latent, "stability-vae", npy_bytes(latent), ".npy"),
            ("images 3x64x64 uint8", image, "pixels", png_bytes(image.transpose(1, 2, 0)), ".png")]:
        make_shards(root / "t.shards", count, sample, encoding)
        make_zip(root / "t.zip", count, member, suffix)
        for fmt, path in (("shards", root / "t.shards"), ("zip", root / "t.zip")):
            rate = throughput(str(path), samples)
            rows.append(dict(kind=kind, format=fmt, samples_per_s_per_core=round(rate),
                             times_one_gpu_edm2_s_img512=round(rate / GPU_IMAGES_PER_S, 1)))
            click.echo(json.dumps(rows[-1]), err=True)
        os.system(f"rm -rf {root / 't.shards'} {root / 't.zip'}")
    return rows


@click.command(context_settings=dict(ignore_unknown_options=True))
@click.option("--counts", default="100000,1000000,10000000", show_default=True, help="Sample counts (memory).")
@click.option("--zip-counts", default="100000,1000000", show_default=True, help="Counts measured as ZIPs too.")
@click.option("--batches", default=20, show_default=True, help="Batches of 256 read before measuring memory.")
@click.option("--throughput-count", default=4096, show_default=True, help="Samples in the throughput datasets.")
@click.option("--throughput-samples", default=2048, show_default=True, help="Samples timed per case.")
@click.option("--out", type=click.Path(path_type=Path), help="Write the tables as JSON here.")
def main(counts: str, zip_counts: str, batches: int, throughput_count: int, throughput_samples: int,
         out: Path | None) -> None:
    """Measure and print both tables as JSON."""
    with tempfile.TemporaryDirectory(dir=out.parent if out else None) as root:
        result = {"load_average": os.getloadavg(), "cpus": os.cpu_count(),
                  "throughput": throughput_table(Path(root), throughput_count, throughput_samples),
                  "memory": memory_table(Path(root), [int(c) for c in counts.split(",")],
                                         [int(c) for c in zip_counts.split(",")], batches)}
    result["load_average_after"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    if out:
        out.write_text(text)
    click.echo(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        memory_child(sys.argv[2], int(sys.argv[3]))
    else:
        main()
