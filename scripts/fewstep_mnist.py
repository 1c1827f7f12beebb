"""Few-step generation on MNIST, measured: a Frechet distance in one fixed feature network for a diffusion teacher
(Heun, DPM-Solver++(2M)) and its consistency students (1 and 2 steps), with a grid per row; the last line is JSON.

No Inception or DINOv2 weights can be had offline, so the features are those of a small convolutional classifier
that the `features` command trains on the digits themselves (seeded; its SHA-256 is printed and recorded in the
table): the distance is comparable between rows of one table, not with published FIDs.

  python scripts/fewstep_mnist.py features --data=datasets/mnist32.zip --dest=mnist-features.safetensors
  python scripts/fewstep_mnist.py table --data=datasets/mnist32.zip --features=mnist-features.safetensors \\
      --teacher=TEACHER.safetensors --student=SCD.safetensors --outdir=fewstep
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import click
import numpy as np
import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: use its edm2, not an installed one
from edm2.consistency_sampler import consistency_sample
from edm2.data.dataset import ImageFolderDataset
from edm2.eval.metrics import FeatureStats, frechet_distance
from edm2.formats.snapshot import load_network
from edm2.procedures.generation import SeededRandom
from edm2.procedures.image_grid import save_png, tile
from edm2.sampler import edm_sampler


class DigitFeatures(torch.nn.Module):
    """A small classifier of 32x32 digits; its 128 penultimate features are the distance's."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(64 * 16, 128), torch.nn.ReLU())
        self.head = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Features [N, 128] of images [N, 1, 32, 32] in [-1, 1]."""
        return self.body(x)


def real_digits(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(images [N, 1, 32, 32] in [-1, 1], labels [N]) of a 32x32 grayscale dataset."""
    dataset = ImageFolderDataset(path)
    images = torch.from_numpy(np.stack([dataset[i][0] for i in range(len(dataset))])).float() / 127.5 - 1
    labels = torch.from_numpy(np.stack([dataset.get_label(i) for i in range(len(dataset))])).argmax(1)
    if images.shape[1:] != (1, 32, 32):
        raise click.BadParameter(f"{path} holds {tuple(images.shape[1:])} images, not 1x32x32", param_hint="--data")
    return images, labels


def stats_of(features: DigitFeatures, images: torch.Tensor) -> FeatureStats:
    """The feature statistics of images [N, 1, 32, 32] in [-1, 1]."""
    stats = FeatureStats(128)
    with torch.no_grad():
        for batch in images.split(500):
            stats.add(features(batch.clamp(-1, 1)))
    return stats


@click.group()
def main():
    """Few-step generation on MNIST: the feature network, then the table."""


@main.command()
@click.option("--data", required=True, help="MNIST at 32x32 (dataset_tool.py convert --resolution=32)")
@click.option("--dest", type=click.Path(dir_okay=False, path_type=Path), required=True, help="New .safetensors")
@click.option("--epochs", type=int, default=8, show_default=True)
def features(data: str, dest: Path, epochs: int):
    """Train the feature network on the digits (seed 0) and save it."""
    images, labels = real_digits(data)
    torch.manual_seed(0)
    net = DigitFeatures()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    for epoch in range(epochs):
        order = torch.randperm(len(images))
        for idx in order.split(64):
            loss = torch.nn.functional.cross_entropy(net.head(net(images[idx])), labels[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch + 1}: loss {loss.item():.4f}")
    safetensors.torch.save_file(net.state_dict(), dest)
    print(f"saved {dest} sha256 {hashlib.sha256(dest.read_bytes()).hexdigest()}")


def sample(net: torch.nn.Module, row: dict, seeds: list[int], batch: int) -> torch.Tensor:
    """Images [N, 1, 32, 32] of one table row from the seeds, labels seed % 10."""
    out = []
    for start in range(0, len(seeds), batch):
        part = seeds[start:start + batch]
        rnd = SeededRandom(part)
        noise = rnd.randn([net.img_channels, net.img_resolution, net.img_resolution])
        labels = torch.eye(net.label_dim)[[s % net.label_dim for s in part]] if net.label_dim else None
        with torch.no_grad():
            if row["kind"] == "cm":
                x = consistency_sample(net, noise, labels, steps=row["steps"], randn_like=rnd.randn_like)
            else:
                x = edm_sampler(net, noise, labels, num_steps=row["steps"], solver=row["solver"],
                                randn_like=rnd.randn_like)
        out.append(x.float().clamp(-1, 1))
    return torch.cat(out)


@main.command()
@click.option("--data", required=True, help="MNIST at 32x32, the reference")
@click.option("--features", "features_path", required=True, help="The feature network (the features command)")
@click.option("--teacher", help="The diffusion teacher's snapshot (its four rows)")
@click.option("--student", "students", multiple=True, help="A consistency student's snapshot (repeatable)")
@click.option("--outdir", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--images", type=int, default=2000, show_default=True, help="Generated images per row")
@click.option("--batch", type=int, default=250, show_default=True)
@click.option("--bf16", is_flag=True, help="Evaluate the networks in bfloat16 on the CPU too (cpu_16bit)")
def table(data: str, features_path: str, teacher: str | None, students: tuple[str, ...], outdir: Path, images: int,
          batch: int, bf16: bool):
    """Frechet distances and grids: teacher with Heun (31, 63 NFE) and DPM-Solver++(2M) (2, 4 NFE), students at 1
    and 2 steps."""
    outdir.mkdir(parents=True, exist_ok=True)
    net_f = DigitFeatures()
    net_f.load_state_dict(safetensors.torch.load_file(features_path))
    net_f.eval()
    real, _ = real_digits(data)
    reference = stats_of(net_f, real).finalize()[0]
    rows = [dict(name="teacher Heun 16 steps", net=teacher, kind="ode", solver="heun", steps=16, nfe=31),
            dict(name="teacher Heun 32 steps", net=teacher, kind="ode", solver="heun", steps=32, nfe=63),
            dict(name="teacher DPM-Solver++(2M) 2 steps", net=teacher, kind="ode", solver="dpm2m", steps=2, nfe=2),
            dict(name="teacher DPM-Solver++(2M) 4 steps", net=teacher, kind="ode", solver="dpm2m", steps=4, nfe=4)
            ] if teacher else []
    for path in students:
        rows += [dict(name=f"{Path(path).name} {s} step{'s' if s > 1 else ''}", net=path, kind="cm", steps=s, nfe=s)
                 for s in (1, 2)]
    seeds = list(range(images))
    results = []
    for row in rows:
        net = load_network(row["net"])[0]
        net.use_bf16, net.cpu_16bit = net.use_bf16 or bf16, bf16
        start = time.monotonic()
        x = sample(net, row, seeds, batch)
        seconds = time.monotonic() - start
        stats = stats_of(net_f, x).finalize()[0]
        fd = frechet_distance(stats["mu"], stats["sigma"], reference["mu"], reference["sigma"])
        grid = ((x[:100] + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        grid_name = f"grid-{Path(row['net']).stem}-{row['solver'] if row['kind'] == 'ode' else 'cm'}-{row['steps']}.png"
        save_png(outdir / grid_name, tile(grid, 10))
        results.append(dict(name=row["name"], nfe=row["nfe"], fd=fd, seconds=round(seconds, 1), grid=grid_name))
        print(f"{row['name']:<48} NFE {row['nfe']:>3}  FD {fd:9.3f}  ({seconds:.0f} s)", flush=True)
    record = dict(images=images, bf16=bf16, features_sha256=hashlib.sha256(Path(features_path).read_bytes()).hexdigest(),
                  rows=results)
    (outdir / f"table-{int(time.time())}.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
