"""Prepare datasets in the release format: convert images, encode them to VAE latents, decode, make a toy set."""

from __future__ import annotations

import functools
import io
import json
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Callable

import click
import numpy as np
import PIL.Image
import torch
from tqdm import tqdm

from edm2 import distributed, files
from edm2.dataset import (LABELS_FILE, DatasetError, FileTree, ImageFolderDataset, dataset_writer, image_fname,
                          is_zip_path, labels_json, latent_fname, npy_bytes, png_bytes)
from edm2.encoders import DEFAULT_VAE, EncoderError, StabilityVAEEncoder
from edm2.toy_shapes import SHAPES, toy_image
from edm2.transforms import center_crop, center_crop_dhariwal, center_crop_wide, resize

DEFAULT_ENCODE_BATCH = 8
ENCODE_MANIFEST = "encode.json"
# Errors PIL raises for files that are not (complete) images; SyntaxError comes from broken chunks.
IMAGE_ERRORS = (OSError, ValueError, SyntaxError, zipfile.BadZipFile, PIL.Image.DecompressionBombError)


def first_line(error: BaseException) -> str:
    """A one-line description of an exception for error messages."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def check_dest(dest: Path) -> None:
    """Refuse to write over anything that exists."""
    if dest.exists():
        raise click.BadParameter(f"{dest} already exists; choose a new path or delete it", param_hint="'--dest'")


def require_single_process(command: str) -> None:
    """convert, decode and toy write one output from one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise click.UsageError(f"{command} runs in one process; start it with python, not torchrun")


class Resolution(click.ParamType):
    """N (square) or WxH."""

    name = "N|WxH"

    def convert(self, value, param, ctx) -> tuple[int, int]:
        """Parse '64' -> (64, 64) and '512x384' -> (512, 384)."""
        if isinstance(value, tuple):
            return value
        match = re.fullmatch(r"\s*(\d+)\s*(?:[x,]\s*(\d+)\s*)?", str(value))
        if not match or int(match[1]) < 1 or int(match[2] or 1) < 1:
            self.fail(f"{value!r} is not N or WxH with positive sizes (for example 64 or 512x384)", param, ctx)
        return int(match[1]), int(match[2] or match[1])


TRANSFORMS = ("center-crop", "center-crop-wide", "center-crop-dhariwal")


def unchanged(image: np.ndarray) -> np.ndarray:
    """No crop or resize."""
    return image


def make_transform(transform: str | None, resolution: tuple[int, int] | None) -> Callable[[np.ndarray], np.ndarray]:
    """The image -> image function for --transform and --resolution; bad combinations are usage errors."""
    if resolution is None:
        if transform is not None:
            raise click.UsageError(f"--transform={transform} needs --resolution")
        return unchanged
    width, height = resolution
    if transform == "center-crop-wide":
        if height > width:
            raise click.BadParameter(f"center-crop-wide needs width >= height, got {width}x{height}",
                                     param_hint="'--resolution'")
        return functools.partial(center_crop_wide, width=width, height=height)
    if width != height:
        raise click.BadParameter(f"{transform or 'resizing'} needs a square resolution (datasets hold square "
                                 f"images), got {width}x{height}", param_hint="'--resolution'")
    if transform == "center-crop-dhariwal":
        return functools.partial(center_crop_dhariwal, size=width)
    if transform == "center-crop":
        return functools.partial(center_crop, width=width, height=height)
    return functools.partial(resize, width=width, height=height)


# ----------------------------------------------------------------------------------------------
# Image sources (convert --source).

def source_labels(names: list[str], files: FileTree) -> dict[str, int] | None:
    """Classes from dataset.json if present, else from top-level folder names (ImageNet's layout)."""
    if LABELS_FILE in files.names:
        try:
            listed = json.loads(files.read(LABELS_FILE))["labels"]
            labels = None if listed is None else {str(name): int(label) for name, label in listed}
        except (ValueError, KeyError, TypeError) as e:
            raise click.ClickException(f"--source: {LABELS_FILE} is not in the release format ({first_line(e)})")
        missing = [name for name in names if labels is not None and name not in labels]
        if missing:
            raise click.ClickException(f"--source: {LABELS_FILE} has no label for {missing[0]}")
        return labels
    folders = {name: name.split("/")[0] if "/" in name else "" for name in names}
    classes = {folder: index for index, folder in enumerate(sorted(set(folders.values())))}
    return {name: classes[folder] for name, folder in folders.items()} if len(classes) > 1 else None


def open_source(source: Path) -> tuple[FileTree, list[str], dict[str, int] | None]:
    """The files of a folder (recursively) or ZIP, the sorted names of its images, and their labels."""
    try:
        files = FileTree(source)
    except DatasetError as e:
        raise click.BadParameter(str(e), param_hint="'--source'")
    extensions = set(PIL.Image.registered_extensions())
    names = [name for name in files.names if Path(name).suffix.lower() in extensions]
    if not names:
        raise click.BadParameter(f"{source} holds no images", param_hint="'--source'")
    return files, names, source_labels(names, files)


def read_rgb(data: bytes) -> np.ndarray:
    """Decode an image file to uint8 HWC RGB (grayscale, palette and alpha images are converted)."""
    with PIL.Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


class ConvertedImages(torch.utils.data.Dataset):
    """Source images read, transformed and PNG-encoded (in DataLoader workers).

    Items are (png bytes, (height, width)), or (None, reason) for a file that cannot be read.
    """

    def __init__(self, files: FileTree, names: list[str], transform: Callable[[np.ndarray], np.ndarray]):
        self.files, self.names, self.transform = files, names, transform

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, idx: int) -> tuple[bytes | None, tuple[int, int] | str]:
        try:
            image = self.transform(read_rgb(self.files.read(self.names[idx])))
        except IMAGE_ERRORS as e:
            return None, first_line(e)
        return png_bytes(image), image.shape[:2]


@click.group()
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
@click.option("--max-images", type=click.IntRange(min=1), help="Convert only the first N images.")
@click.option("--on-error", type=click.Choice(["stop", "skip"]), default="stop", show_default=True,
              help="What to do with an image that cannot be read.")
@click.option("--workers", default=min(8, os.cpu_count() or 1), show_default=True, type=click.IntRange(min=0),
              help="Processes reading and cropping images.")
def convert(source: Path, dest: Path, resolution: tuple[int, int] | None, transform: str | None,
            max_images: int | None, on_error: str, workers: int) -> None:
    """Crop/resize a folder or ZIP of images into a dataset of PNGs.

    Image i of the sorted source list becomes NNNNN/imgIIIIIIII.png (NNNNN = i // 1000); a
    skipped image leaves its index unused. Nothing is written unless the whole run succeeds.

    \b
    python dataset_tool.py convert --source=imagenet/train --dest=datasets/img64.zip \\
        --resolution=64 --transform=center-crop-dhariwal
    """
    require_single_process("convert")
    check_dest(dest)
    transform_image = make_transform(transform, resolution)
    files, names, labels = open_source(source)
    names = names[:max_images]
    images = torch.utils.data.DataLoader(ConvertedImages(files, names, transform_image), batch_size=None,
                                         num_workers=workers)
    size, skipped = None, 0
    with dataset_writer(dest) as writer:
        for idx, (png, shape) in enumerate(tqdm(images, desc="convert", unit="img")):
            name = names[idx]
            if png is None:
                if on_error == "stop":
                    raise click.ClickException(f"cannot read image {name} in {source} ({shape}); "
                                               f"--on-error=skip leaves such images out")
                tqdm.write(f"skipping {name}: cannot read it ({shape})", file=sys.stderr)
                skipped += 1
                continue
            if size is None:
                size = shape
                if size[0] != size[1]:
                    raise click.ClickException(f"{name} is {size[1]}x{size[0]}, not square; datasets hold square "
                                               f"images: use --resolution and --transform")
            elif shape != size:
                raise click.ClickException(f"{name} is {shape[1]}x{shape[0]} but earlier images are "
                                           f"{size[1]}x{size[0]}; use --resolution and --transform to make "
                                           f"them equal")
            writer.add(image_fname(idx), png, None if labels is None else labels[name])
        if size is None:
            raise click.ClickException(f"no image of {source} could be read")
    click.echo(f"wrote {len(names) - skipped} images to {dest}" + (f" ({skipped} skipped)" if skipped else ""))


# ----------------------------------------------------------------------------------------------
# VAE encoding and decoding.

class IndexedImages(torch.utils.data.Dataset):
    """(index, image) items, so that a batch knows which files it holds."""

    def __init__(self, dataset: ImageFolderDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> tuple[int, np.ndarray]:
        return idx, self.dataset[idx][0]


def batches_of(dataset: ImageFolderDataset, batches: list[list[int]], workers: int) -> torch.utils.data.DataLoader:
    """Load the given index batches, with worker processes reading files ahead."""
    return torch.utils.data.DataLoader(IndexedImages(dataset), batch_sampler=batches, num_workers=workers)


def open_dataset(source: Path, suffix: str) -> ImageFolderDataset:
    """A source dataset of .png or .npy files; problems become one-line click errors."""
    try:
        dataset = ImageFolderDataset(source)
    except DatasetError as e:
        raise click.BadParameter(str(e), param_hint="'--source'")
    if not dataset.fnames[0].lower().endswith(suffix):
        raise click.BadParameter(f"{source} holds {Path(dataset.fnames[0]).suffix} files, expected {suffix}",
                                 param_hint="'--source'")
    if suffix == ".png" and dataset.num_channels != 3:
        raise click.BadParameter(f"{source} holds {dataset.num_channels}-channel images, expected RGB",
                                 param_hint="'--source'")
    return dataset


def dataset_problem(error: DatasetError) -> click.ClickException:
    """Click error for a file that failed to load, also when a DataLoader worker wrapped the message."""
    return click.ClickException(str(error).strip().splitlines()[-1].split("DatasetError: ", 1)[-1])


def label_of(dataset: ImageFolderDataset, idx: int) -> int | None:
    """Class index of item idx, None for unlabeled datasets."""
    return None if dataset.raw_labels is None else int(dataset.raw_labels[idx])


def block_batches(count: int, batch: int, blocks: list[int] | None = None) -> list[list[int]]:
    """Index lists of the fixed blocks [k * batch, (k + 1) * batch) of count images (all blocks by default)."""
    if blocks is None:
        blocks = list(range((count + batch - 1) // batch))
    return [list(range(k * batch, min((k + 1) * batch, count))) for k in blocks]


def prepare_work_dir(work: Path, manifest: dict) -> str | None:
    """Create the work directory of an encode, or check that an existing one belongs to this encode."""
    manifest_path = work / ENCODE_MANIFEST
    if not work.exists():
        with files.atomic_path(manifest_path) as tmp:
            tmp.write_text(json.dumps(manifest, indent=2))
        return None
    try:
        previous = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        return f"{work} exists but is not an unfinished encode ({first_line(e)}); delete it or choose another --dest"
    changed = [f"{key} {previous.get(key)!r} -> {value!r}" for key, value in manifest.items()
               if previous.get(key) != value]
    if changed and not any(work.glob("*/img-mean-std-*.npy")):
        manifest_path.write_text(json.dumps(manifest, indent=2))  # nothing encoded yet: start afresh
        return None
    if changed:
        return (f"{work} holds an unfinished encode with other settings ({'; '.join(changed)}); "
                f"rerun with the same options or delete it")
    return None


def pending_blocks(work: Path, count: int, batch: int) -> list[int]:
    """Blocks of `batch` images with at least one latent file still missing."""
    done = {path.relative_to(work).as_posix() for path in work.glob("*/img-mean-std-*.npy")}
    return [k for k, indices in enumerate(block_batches(count, batch))
            if any(latent_fname(i) not in done for i in indices)]


def finish_encode(work: Path, dest: Path, dataset: ImageFolderDataset, count: int) -> None:
    """Turn a complete work directory into the output dataset (ZIP or directory) with dataset.json."""
    names = [latent_fname(i) for i in range(count)]
    if is_zip_path(dest):
        with dataset_writer(dest) as writer:
            for idx, name in enumerate(tqdm(names, desc="write ZIP", unit="img")):
                writer.add(name, (work / name).read_bytes(), label_of(dataset, idx))
        shutil.rmtree(work)
        return
    for leftover in [work / ENCODE_MANIFEST, *work.glob(".*.tmp"), *work.glob("*/.*.tmp")]:
        leftover.unlink()
    with files.atomic_path(work / LABELS_FILE) as tmp:
        tmp.write_text(labels_json({name: label_of(dataset, idx) for idx, name in enumerate(names)}))
    os.replace(work, dest)


def vae_options(command: Callable) -> Callable:
    """The --vae, --batch and --max-images options of encode and decode."""
    for option in reversed([
        click.option("--vae", default=DEFAULT_VAE, show_default=True,
                     help="diffusers AutoencoderKL: hub name or local directory."),
        click.option("--batch", default=DEFAULT_ENCODE_BATCH, show_default=True, type=click.IntRange(min=1),
                     help="Images per VAE call (per process)."),
        click.option("--max-images", type=click.IntRange(min=1), help="Process only the first N images."),
    ]):
        command = option(command)
    return command


@main.command()
@click.option("--source", required=True, type=click.Path(exists=True, path_type=Path),
              help="Dataset of RGB PNGs (directory or ZIP), e.g. from convert.")
@click.option("--dest", required=True, type=click.Path(path_type=Path), help="Output .zip or directory.")
@vae_options
@click.option("--workers", default=2, show_default=True, type=click.IntRange(min=0),
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
    distributed.init()
    try:
        run_encode(source, dest, vae, batch, max_images, workers)
    finally:
        distributed.shutdown()


def run_encode(source: Path, dest: Path, vae: str, batch: int, max_images: int | None, workers: int) -> None:
    """encode's work on every rank; rank 0 prepares and assembles."""
    check_dest(dest)
    dataset = open_dataset(source, ".png")
    count = min(len(dataset), max_images or len(dataset))
    work = dest.with_name(dest.name + ".partial")
    manifest = {"source": str(source.resolve()), "images": count, "image_shape": dataset.image_shape, "vae": vae}
    encoder = StabilityVAEEncoder(vae, batch_size=batch)
    device = distributed.device()
    try:
        encoder.init(device)  # a VAE that cannot load should fail before any progress folder exists
    except EncoderError as e:
        raise click.BadParameter(str(e), param_hint="'--vae'")
    problem, pending = None, []
    if distributed.is_main():
        problem = prepare_work_dir(work, manifest)
        pending = [] if problem else pending_blocks(work, count, batch)
    problem, pending = distributed.broadcast_object((problem, pending))
    if problem:
        raise click.UsageError(problem)
    blocks = pending[distributed.get_rank()::distributed.get_world_size()]
    # Batches are fixed blocks of the whole dataset, so every image is always encoded in the same
    # company and the output is bit-identical whatever the interruptions or number of processes.
    batches = block_batches(count, batch, blocks)
    done = count - sum(map(len, block_batches(count, batch, pending)))
    if distributed.is_main() and done:
        click.echo(f"resuming from {work}: {done} of {count} images already encoded")
    with tqdm(total=sum(map(len, batches)), desc="encode", unit="img", disable=not distributed.is_main()) as bar:
        try:
            for indices, images in batches_of(dataset, batches, workers):
                latents = encoder.encode_pixels(images.to(device)).cpu().numpy()
                for idx, latent in zip(indices.tolist(), latents):
                    path = work / latent_fname(idx)
                    if not path.exists():
                        with files.atomic_path(path) as tmp:
                            tmp.write_bytes(npy_bytes(latent))
                bar.update(len(indices))
        except DatasetError as e:
            raise dataset_problem(e)
    distributed.barrier()
    if distributed.is_main():
        missing = pending_blocks(work, count, batch)
        if missing:
            raise click.ClickException(f"{work}: images of {len(missing)} batches are missing; rerun to finish")
        finish_encode(work, dest, dataset, count)
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
    require_single_process("decode")
    check_dest(dest)
    dataset = open_dataset(source, ".npy")
    channels = dataset.num_channels
    if channels % 2:
        raise click.BadParameter(f"{source} has {channels} channels; mean/std latents have an even count",
                                 param_hint="'--source'")
    count = min(len(dataset), max_images or len(dataset))
    encoder = StabilityVAEEncoder(vae, batch_size=batch)
    device = distributed.device()
    batches = block_batches(count, batch)
    with dataset_writer(dest) as writer, tqdm(total=count, desc="decode", unit="img") as bar:
        try:
            for indices, latents in batches_of(dataset, batches, 0):
                pixels = encoder.decode_raw(latents[:, :channels // 2].to(device))
                for idx, image in zip(indices.tolist(), pixels.permute(0, 2, 3, 1).cpu().numpy()):
                    writer.add(image_fname(idx), png_bytes(image), label_of(dataset, idx))
                bar.update(len(indices))
        except EncoderError as e:
            raise click.BadParameter(str(e), param_hint="'--vae'")
        except DatasetError as e:
            raise dataset_problem(e)
    click.echo(f"wrote {count} images to {dest}")


@main.command()
@click.option("--dest", required=True, type=click.Path(path_type=Path), help="Output .zip or directory.")
@click.option("--resolution", default=32, show_default=True, type=click.IntRange(min=8), help="Image size.")
@click.option("--num", default=10000, show_default=True, type=click.IntRange(min=1), help="Number of images.")
@click.option("--classes", default=6, show_default=True, type=click.IntRange(min=1),
              help=f"Number of shape classes, at most {len(SHAPES)}: {', '.join(SHAPES)}.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0), help="Random seed.")
def toy(dest: Path, resolution: int, num: int, classes: int, seed: int) -> None:
    """Make a labeled dataset of coloured shapes (class = shape) that a small model learns quickly on a CPU.

    Image i shows shape i % classes; its colour, size and position come from the seed and i alone.

    \b
    python dataset_tool.py toy --dest=datasets/toy32.zip --resolution=32 --num=10000 --classes=6
    """
    require_single_process("toy")
    if classes > len(SHAPES):
        raise click.BadParameter(f"{classes} classes asked for, but only {len(SHAPES)} shapes exist "
                                 f"({', '.join(SHAPES)})", param_hint="'--classes'")
    check_dest(dest)
    kinds = list(SHAPES)[:classes]
    with dataset_writer(dest) as writer:
        for idx in tqdm(range(num), desc="toy", unit="img"):
            image = toy_image(kinds[idx % classes], resolution, np.random.default_rng([seed, idx]))
            writer.add(image_fname(idx), png_bytes(image), idx % classes)
    click.echo(f"wrote {num} images of {classes} classes ({', '.join(kinds)}) to {dest}")


if __name__ == "__main__":
    main()
