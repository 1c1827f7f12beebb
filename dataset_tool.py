"""Prepare datasets in the release format: convert images, encode them to VAE latents, decode, make a toy set."""

from __future__ import annotations

import cli.wait_policy  # noqa: F401  first: PyTorch's OpenMP reads its wait policy once, when it loads
import contextlib
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

import click
import numpy as np
from tqdm import tqdm

from cli.command import Group
from cli.types import MAX_BATCH, MAX_IMAGES, MAX_SEED_OPTION, MAX_WORKERS, Integer, Resolution
from edm2.data.convert import (CHANNEL_MODES, ImageSizeError, UnreadableImageError, choose_mode, convert_images,
                               open_image_source)
from edm2.data.dataset import DatasetError, ImageFolderDataset, image_fname
from edm2.data.dataset_writer import dataset_writer, png_bytes
from edm2.data.toy_shapes import SHAPES, toy_image
from edm2.data.transforms import TRANSFORMS, TransformError, make_transform
from edm2.data.vae_datasets import decoded_images, encode_dataset, label_of
from edm2.encoders import DEFAULT_VAE, EncoderError, StabilityVAEEncoder
from edm2.runtime import distributed, files, locks

DEFAULT_ENCODE_BATCH = 8
MAX_TOY_RESOLUTION = 1024  # the toy shapes are for small models: 16 or 32 pixels


@contextlib.contextmanager
def claimed_dest(dest: Path, command: str) -> Iterator[None]:
    """Hold dest for the block (one writer at a time: edm2.runtime.locks), refusing a dest that exists or cannot be
    written; remove what killed earlier runs left."""
    try:
        files.check_writable_dir(dest.parent)
    except files.OutputError as e:
        raise click.BadParameter(str(e), param_hint="'--dest'") from None
    with locks.hold_destination(dest, f"dataset_tool.py {command}"):
        if os.path.lexists(dest):  # looked at under the lock: a writer that held it until now has finished it
            raise click.BadParameter(f"{dest} already exists; choose a new path or delete it", param_hint="'--dest'")
        files.remove_stale_temporaries(dest.parent, name=dest.name)
        yield


def transform_for(transform: str | None, resolution: tuple[int, int] | None) -> Callable[[np.ndarray], np.ndarray]:
    """The image -> image function of --transform and --resolution; bad combinations are usage errors."""
    if resolution is None and transform is not None:
        raise click.UsageError(f"--transform={transform} needs --resolution")
    try:
        return make_transform(transform, resolution)
    except TransformError as e:
        raise click.BadParameter(str(e), param_hint="'--resolution'") from None


def open_dataset(source: Path, suffix: str) -> ImageFolderDataset:
    """A source dataset of .png (RGB) or .npy files; problems name --source."""
    try:
        dataset = ImageFolderDataset(source)
    except DatasetError as e:
        raise click.BadParameter(str(e), param_hint="'--source'") from None
    if not dataset.fnames[0].lower().endswith(suffix):
        raise click.BadParameter(f"{source} holds {Path(dataset.fnames[0]).suffix} files, expected {suffix}",
                                 param_hint="'--source'")
    if suffix == ".png" and dataset.num_channels != 3:
        raise click.BadParameter(f"{source} holds {dataset.num_channels}-channel images, expected RGB",
                                 param_hint="'--source'")
    return dataset


def load_vae(vae: str, batch: int) -> StabilityVAEEncoder:
    """The encoder with its VAE loaded now, so that a VAE that cannot load fails before any work."""
    encoder = StabilityVAEEncoder(vae, batch_size=batch)
    try:
        encoder.init(distributed.device())
    except EncoderError as e:
        raise click.BadParameter(str(e), param_hint="'--vae'") from None
    return encoder


def report_skip(name: str, reason: str) -> None:
    """convert --on-error=skip: say which image is left out and why."""
    tqdm.write(f"skipping {name}: cannot read it ({reason})", file=sys.stderr)


@click.group(cls=Group)
def main() -> None:
    """Prepare datasets in the release format (directory or uncompressed ZIP of PNG/NPY + dataset.json).

    \b
    python dataset_tool.py toy --dest=datasets/toy32.zip --resolution=32 --num=10000 --classes=6
    python dataset_tool.py convert --source=imagenet/train --dest=datasets/img512.zip \\
        --resolution=512 --transform=center-crop-dhariwal
    torchrun --nproc_per_node=8 dataset_tool.py encode --source=datasets/img512.zip \\
        --dest=datasets/img512-sd.zip
    python dataset_tool.py decode --source=datasets/img512-sd.zip --dest=out/decoded.zip --max-images=64
    """


@main.command()
@click.option("--source", required=True, type=click.Path(exists=True, path_type=Path),
              help="Folder (class sub-folders give labels; dataset.json is honoured) or ZIP of images.")
@click.option("--dest", required=True, type=click.Path(path_type=Path), help="Output .zip or directory.")
@click.option("--resolution", type=Resolution(), help="Output size N or WxH (WxH only for center-crop-wide).")
@click.option("--transform", type=click.Choice(TRANSFORMS), help="Crop/resize mode (needs --resolution).")
@click.option("--max-images", type=Integer(1, MAX_IMAGES), help="Convert only the first N images.")
@click.option("--on-error", type=click.Choice(["stop", "skip"]), default="stop", show_default=True,
              help="What to do with an image that cannot be read.")
@click.option("--workers", default=min(8, os.cpu_count() or 1), show_default=True, type=Integer(0, MAX_WORKERS),
              help="Processes reading and cropping images.")
@click.option("--channels", type=click.Choice(list(CHANNEL_MODES)), default="auto", show_default=True,
              help="PNG channels: 1 (grayscale), 3 (RGB), or auto: 1 when every source image is grayscale, else 3.")
def convert(source: Path, dest: Path, resolution: tuple[int, int] | None, transform: str | None,
            max_images: int | None, on_error: str, workers: int, channels: str) -> None:
    """Crop/resize a folder or ZIP of images into a dataset of PNGs.

    Image i of the sorted source list becomes NNNNN/imgIIIIIIII.png (NNNNN = i // 1000); a
    skipped image leaves its index unused. Nothing is written unless the whole run succeeds.
    Top-level class folders (symbolic links followed) give the labels, numbered in sorted folder order (printed
    at the end).
    Grayscale sources (every image in PIL mode 1, L, LA, I or F) stay one-channel unless --channels=3;
    with any colour image among them all become RGB. Alpha is dropped.

    \b
    python dataset_tool.py convert --source=imagenet/train --dest=datasets/img64.zip \\
        --resolution=64 --transform=center-crop-dhariwal
    """
    with distributed.session(single_process=True), claimed_dest(dest, "convert"):
        transform_image = transform_for(transform, resolution)
        try:
            images = open_image_source(source)
        except DatasetError as e:
            raise click.BadParameter(str(e), param_hint="'--source'") from None
        mode = choose_mode(images, channels, max_images)
        with dataset_writer(dest) as writer:
            try:
                written = convert_images(images, writer, transform_image, max_images, workers,
                                         on_skip=report_skip if on_error == "skip" else None, mode=mode)
            except UnreadableImageError as e:
                raise click.ClickException(f"{e}; --on-error=skip leaves such images out") from None
            except ImageSizeError as e:
                raise click.ClickException(f"{e}; use --resolution and --transform to make them square and "
                                           f"equal") from None
    skipped = len(images.names[:max_images]) - written
    kind = "grayscale (1 channel)" if mode == "L" else "RGB"
    click.echo(f"wrote {written} {kind} images to {dest}" + (f" ({skipped} skipped)" if skipped else ""))
    if images.classes:
        click.echo("labels from the class folders (dataset.json's numbers):")
        for label, folder in enumerate(images.classes):
            click.echo(f"  {label}: {folder}")


def vae_options(command: Callable) -> Callable:
    """The --vae, --batch and --max-images options of encode and decode."""
    for option in reversed([
        click.option("--vae", default=DEFAULT_VAE, show_default=True,
                     help="diffusers AutoencoderKL: hub name or local directory."),
        click.option("--batch", default=DEFAULT_ENCODE_BATCH, show_default=True, type=Integer(1, MAX_BATCH),
                     help="Images per VAE call (per process)."),
        click.option("--max-images", type=Integer(1, MAX_IMAGES), help="Process only the first N images."),
    ]):
        command = option(command)
    return command


@main.command()
@click.option("--source", required=True, type=click.Path(exists=True, path_type=Path),
              help="Dataset of RGB PNGs (directory or ZIP), e.g. from convert.")
@click.option("--dest", required=True, type=click.Path(path_type=Path), help="Output .zip or directory.")
@vae_options
@click.option("--workers", default=2, show_default=True, type=Integer(0, MAX_WORKERS),
              help="Data-loading processes per GPU process.")
def encode(source: Path, dest: Path, vae: str, batch: int, max_images: int | None, workers: int) -> None:
    """Encode pixels into 8-channel float32 VAE mean/std latents (NNNNN/img-mean-std-IIIIIIII.npy).

    Under torchrun the images are split across processes. Progress is kept in DEST.partial/ (one
    file per image); running the same command again continues from there, and the finished dataset
    replaces the folder. The result does not depend on interruptions or the number of processes.

    \b
    torchrun --nproc_per_node=8 dataset_tool.py encode --source=datasets/img512.zip \\
        --dest=datasets/img512-sd.zip
    """
    with distributed.session(), claimed_dest(dest, "encode"):
        dataset = open_dataset(source, ".png")
        count = min(len(dataset), max_images or len(dataset))
        manifest = {"source": str(source.resolve()), "images": count, "image_shape": dataset.image_shape,
                    "vae": vae}
        encoder = load_vae(vae, batch)  # before the progress folder exists
        encode_dataset(dataset, dest, encoder, count, batch, workers, manifest, report=click.echo)
        if distributed.is_main():
            click.echo(f"wrote {count} latents to {dest}")


@main.command()
@click.option("--source", required=True, type=click.Path(exists=True, path_type=Path),
              help="Latent dataset of mean/std .npy files (directory or ZIP).")
@click.option("--dest", required=True, type=click.Path(path_type=Path), help="Output .zip or directory of PNGs.")
@vae_options
def decode(source: Path, dest: Path, vae: str, batch: int, max_images: int | None) -> None:
    """Decode the mean of each stored latent back to a PNG, to look at a latent dataset.

    \b
    python dataset_tool.py decode --source=datasets/img512-sd.zip --dest=out/decoded --max-images=100
    """
    with distributed.session(single_process=True), claimed_dest(dest, "decode"):
        dataset = open_dataset(source, ".npy")
        if dataset.num_channels % 2:
            raise click.BadParameter(f"{source} has {dataset.num_channels} channels; mean/std latents have an "
                                     f"even count", param_hint="'--source'")
        count = min(len(dataset), max_images or len(dataset))
        encoder = load_vae(vae, batch)
        with dataset_writer(dest) as writer:
            for idx, image in tqdm(decoded_images(dataset, encoder, count, batch, distributed.device()),
                                   total=count, desc="decode", unit="img"):
                writer.add(image_fname(idx), png_bytes(image), label_of(dataset, idx))
    click.echo(f"wrote {count} images to {dest}")


@main.command()
@click.option("--dest", required=True, type=click.Path(path_type=Path), help="Output .zip or directory.")
@click.option("--resolution", default=32, show_default=True, type=Integer(8, MAX_TOY_RESOLUTION), help="Image size.")
@click.option("--num", default=10000, show_default=True, type=Integer(1, MAX_IMAGES), help="Number of images.")
@click.option("--classes", default=6, show_default=True, type=Integer(1, len(SHAPES)),
              help=f"Number of shape classes, at most {len(SHAPES)}: {', '.join(SHAPES)}.")
@click.option("--seed", default=0, show_default=True, type=Integer(0, MAX_SEED_OPTION), help="Random seed.")
def toy(dest: Path, resolution: int, num: int, classes: int, seed: int) -> None:
    """Make a labeled dataset of coloured shapes (class = shape) that a small model learns quickly on a CPU.

    Image i shows shape i % classes; its colour, size and position come from the seed and i alone.

    \b
    python dataset_tool.py toy --dest=datasets/toy32.zip --resolution=32 --num=10000 --classes=6
    """
    with distributed.session(single_process=True):
        kinds = list(SHAPES)[:classes]
        with claimed_dest(dest, "toy"), dataset_writer(dest) as writer:
            for idx in tqdm(range(num), desc="toy", unit="img"):
                image = toy_image(kinds[idx % classes], resolution, np.random.default_rng([seed, idx]))
                writer.add(image_fname(idx), png_bytes(image), idx % classes)
    click.echo(f"wrote {num} images of {classes} classes ({', '.join(kinds)}) to {dest}")


if __name__ == "__main__":
    main()
