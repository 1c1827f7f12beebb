"""Generate images with the EDM sampler from our snapshots or the release's published EDM2 models."""

from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path
from typing import Callable, Sequence

import click
import numpy as np
import PIL.Image
import torch

from cli.command import Command
from cli.solver import solver_option
from cli.speed import sampling_speed_options
from cli.types import Number, SeedList, SigmaInterval
from edm2 import distributed, files, locks
from edm2.errors import EDM2Error, one_line
from edm2.generation import (GRID_FILE, LABELS_FILE, GenerationError, check_guidance_pair, generate_labeled_images,
                             read_generated_labels, save_generated_labels)
from edm2.presets_generate import DEFAULT_PRESET, PRESETS
from edm2.sampler import check_settings
from edm2.snapshot import load_generator, load_network

# generate.py --grid: a one-pixel gap of this value between the images, and in the empty cells of the last row.
GRID_GAP_VALUE = 255


def resolve_networks(preset: str | None, net: str | None, gnet: str | None, guidance: float | None):
    """Fill --net, --gnet and --guidance from the preset where not given; check they fit together."""
    if preset is None and net is None:
        preset = DEFAULT_PRESET
    if preset is not None:
        if preset not in PRESETS:
            raise click.BadParameter(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}", param_hint="--preset")
        chosen = PRESETS[preset]
        net = net or chosen.net
        gnet = gnet or chosen.gnet
        guidance = chosen.guidance if guidance is None else guidance
    guidance = 1.0 if guidance is None else guidance
    if guidance != 1 and gnet is None:
        raise click.UsageError(f"--guidance={guidance:g} needs a guiding network: give --gnet or a --preset that has one")
    return net, gnet, guidance


def check_before_work(outdir: str, guidance: float, guidance_interval: tuple[float, float] | None,
                      sampler_kwargs: dict) -> None:
    """Refuse sampler settings that cannot work and an output folder that cannot be written, before any loading."""
    if sampler_kwargs["sigma_min"] >= sampler_kwargs["sigma_max"]:
        raise click.BadParameter("must be below --sigma_max", param_hint="--sigma_min")
    if guidance_interval is not None and guidance == 1:
        raise click.BadParameter("applies only with guidance: give --guidance other than 1 and --gnet (or a --preset "
                                 "that has them)", param_hint="--guidance-interval")
    check_settings(guidance=guidance, **sampler_kwargs)
    files.check_writable_dir(outdir)


def earlier_labels(outdir: Path) -> dict[str, int]:
    """The labels of earlier runs into outdir (read under its lock); a labels file that is not ours names --outdir."""
    try:
        return read_generated_labels(outdir / LABELS_FILE)
    except GenerationError as e:
        raise click.BadParameter(str(e), param_hint="--outdir") from None


def load_for_option(option: str, load: Callable[[str], tuple], path_or_url: str) -> tuple:
    """load(path_or_url) on rank 0 first (it alone downloads); a failure is one line that names the option."""
    try:
        return distributed.main_rank_first(functools.partial(load, path_or_url))
    except (EDM2Error, OSError) as e:
        raise click.ClickException(f"{option}: {one_line(e)}") from None


def load_networks(net_path: str, gnet_path: str | None, guidance: float, class_idx: int | None):
    """(net, gnet or None, encoder) on this rank's device; gnet is loaded only when guidance uses it."""
    net, encoder, _ = load_for_option("--net", load_generator, net_path)
    gnet = load_for_option("--gnet", load_network, gnet_path)[0] if guidance != 1 else None
    if gnet is not None:
        try:
            check_guidance_pair(net, gnet)
        except GenerationError as e:
            raise click.BadParameter(str(e), param_hint="--gnet") from None
    if class_idx is not None and class_idx >= net.label_dim:
        raise click.BadParameter(f"{class_idx} is not a class of this network ({net.label_dim} classes)", param_hint="--class")
    device = distributed.device()
    return net.to(device), (gnet.to(device) if gnet is not None else None), encoder


def save_png(path: Path, image: np.ndarray) -> None:
    """Write one HWC uint8 image as PNG through a temporary file."""
    pil = PIL.Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image)
    with files.atomic_path(path) as tmp:  # a full disk's error names the image
        pil.save(tmp, format="PNG")


def gather_grid(seeds: Sequence[int], generated: dict[int, np.ndarray]) -> np.ndarray | None:
    """Tile every rank's images, in seed order, into one HWC array on rank 0 (None elsewhere), with a one-pixel
    gap of GRID_GAP_VALUE between them."""
    shape = distributed.broadcast_object(next(iter(generated.values())).shape if distributed.is_main() else None)
    stack = torch.zeros([len(seeds), *shape], dtype=torch.uint8, device=distributed.device())
    for i, seed in enumerate(seeds):
        if seed in generated:
            stack[i] = torch.from_numpy(generated[seed])
    # Each image comes from exactly one rank, so a sum gathers them without overflow.
    stack = distributed.all_reduce_sum(stack).cpu().numpy()
    if not distributed.is_main():
        return None
    cols = math.ceil(math.sqrt(len(seeds)))
    rows = math.ceil(len(seeds) / cols)
    h, w, c = shape
    grid = np.full([rows * (h + 1) - 1, cols * (w + 1) - 1, c], GRID_GAP_VALUE, dtype=np.uint8)
    for i, image in enumerate(stack):
        top, left = (i // cols) * (h + 1), (i % cols) * (w + 1)
        grid[top : top + h, left : left + w] = image
    return grid


def image_path(outdir: Path, seed: int, subdirs: bool) -> Path:
    """Where the image of a seed goes: OUTDIR/SEED.png, or OUTDIR/BLOCK/SEED.png with --subdirs."""
    return outdir / (f"{seed - seed % 1000:06d}" if subdirs else "") / f"{seed:06d}.png"


def save_labels(outdir: Path, earlier: dict[str, int], labels: dict[str, int]) -> None:
    """Gather every rank's {image name: class} and write them, with those of earlier runs, to OUTDIR/labels.json."""
    gathered = distributed.all_gather_object(labels)
    if distributed.is_main():
        merged = dict(earlier)
        for part in gathered:
            merged.update(part)
        save_generated_labels(outdir / LABELS_FILE, merged)


@click.command(cls=Command, epilog="""\b
Examples:
  # 64 images from the release's EDM2-S (ImageNet-512), guided by its XS unconditional model, into out/
  python generate.py --guidance=1.4
  # A named release preset, 8 GPUs
  torchrun --nproc_per_node=8 generate.py --preset=edm2-img512-xxl-guid-fid --seeds=0-49999 --subdirs
  # Our own snapshot, class 88 only, plus grid.png for a quick look
  python generate.py --net=training-runs/run/network-snapshot-0008388-0.100.safetensors --class=88 --seeds=0-15 --grid
""")
@click.option("--preset", help="Release configuration preset (net, gnet and guidance) [default: edm2-img512-s-guid-fid without --net]")
@click.option("--net", help="Main network: our .safetensors snapshot or a release .pkl, path or URL")
@click.option("--gnet", help="Guiding network for --guidance other than 1: path or URL")
@click.option("--outdir", type=click.Path(file_okay=False), default="out", show_default=True, help="Where to save the images")
@click.option("--subdirs", is_flag=True, help="Put each block of 1000 seeds in its own subdirectory")
@click.option("--seeds", type=SeedList(), default="0-63", show_default=True, help="Seeds: list and/or ranges, e.g. 0-63,100")
@click.option("--class", "class_idx", type=click.IntRange(min=0), help="Class label for every image [default: random per seed]")
@click.option("--batch", "batch_size", type=click.IntRange(min=1), default=32, show_default=True, help="Images per batch and process")
@click.option("--steps", "num_steps", type=click.IntRange(min=1), default=32, show_default=True, help="Sampling steps")
@solver_option
@click.option("--sigma_min", type=Number(min=0, min_open=True), default=0.002, show_default=True, help="Lowest noise level")
@click.option("--sigma_max", type=Number(min=0, min_open=True), default=80, show_default=True, help="Highest noise level")
@click.option("--rho", type=Number(min=0, min_open=True), default=7, show_default=True, help="Time step exponent")
@click.option("--guidance", type=Number(), help="Guidance strength w of Eq. 152; 1 = no guidance [default: from preset, else 1]")
@click.option("--S_churn", "S_churn", type=Number(min=0), default=0, show_default=True, help="Stochasticity strength")
@click.option("--S_min", "S_min", type=Number(min=0), default=0, show_default=True, help="Stochasticity from this noise level")
@click.option("--S_max", "S_max", type=Number(min=0, allow_inf=True), default=float("inf"), show_default=True,
              help="Stochasticity up to this noise level")
@click.option("--S_noise", "S_noise", type=Number(min=0), default=1, show_default=True, help="Stochastic noise inflation")
@click.option("--grid", is_flag=True, help="Also save all images, in seed order, as one grid.png (one-pixel white gaps)")
@click.option("--guidance-interval", type=SigmaInterval(), default=None,
              help="Guide only the steps whose noise level sigma lies in (SIGMA_LO, SIGMA_HI], e.g. 0.28,5.42 "
                   "(Kynkaanniemi et al. 2024); unguided elsewhere  [default: every step]")
@sampling_speed_options
def main(preset, net, gnet, outdir, subdirs, seeds, class_idx, batch_size, guidance, grid, guidance_interval, speed,
         **sampler_kwargs):
    """Generate images with the EDM sampler (EDM2 paper Appendix D.1) and save them as PNG.

    A conditional network's images get their classes in OUTDIR/labels.json ({"labels": [[file, class], ...]},
    the release's dataset.json format; the entries of earlier runs into the same folder are kept).
    """
    net_path, gnet_path, guidance = resolve_networks(preset, net, gnet, guidance)
    check_before_work(outdir, guidance, guidance_interval, sampler_kwargs)
    outdir = Path(outdir)
    # One run at a time writes outdir: two would each write labels.json with their own images only.
    with distributed.session(), locks.hold_destination(outdir, "generate.py", locks.FOLDER_LOCK):
        earlier = distributed.main_rank_first(functools.partial(earlier_labels, outdir))
        if distributed.is_main():  # what an earlier, killed run left half-written
            files.remove_stale_temporaries(outdir, recursive=subdirs)
        net, gnet, encoder = load_networks(net_path, gnet_path, guidance, class_idx)
        net, gnet = (speed.apply(n, distributed.device()) if n is not None else None for n in (net, gnet))
        interval = "" if guidance_interval is None else " for sigma in ({:g}, {:g}]".format(*guidance_interval)
        distributed.print0(f"Generating {len(seeds)} images from {net_path}"
                           + (f", guided by {gnet_path} at {guidance:g}{interval}" if gnet is not None else ""))
        batches = generate_labeled_images(net, encoder, seeds, class_idx=class_idx, gnet=gnet, guidance=guidance,
                                          batch_size=batch_size, device=distributed.device(),
                                          guidance_interval=guidance_interval, **sampler_kwargs)
        generated, labels = {}, {}
        with contextlib.closing(batches):  # on an error, the progress bar ends before the error line
            for batch_seeds, images, classes in batches:
                for i, (seed, image) in enumerate(zip(batch_seeds, images.permute(0, 2, 3, 1).cpu().numpy())):
                    path = image_path(outdir, seed, subdirs)
                    save_png(path, image)
                    if classes is not None:
                        labels[path.relative_to(outdir).as_posix()] = classes[i]
                    if grid:
                        generated[seed] = image
        if net.label_dim:
            save_labels(outdir, earlier, labels)
        if grid:
            tiles = gather_grid(seeds, generated)
            if tiles is not None:
                save_png(outdir / GRID_FILE, tiles)
        distributed.barrier()
        extras = [name for name, made in ((LABELS_FILE, net.label_dim), (GRID_FILE, grid)) if made]
        listed = ", ".join([f"{len(seeds)} images", *extras[:-1]]) + "".join(f" and {name}" for name in extras[-1:])
        distributed.print0(f"Saved {listed} in {outdir}")


if __name__ == "__main__":
    main()
