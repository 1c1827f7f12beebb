"""What dataset_tool.py's commands share: a claimed destination, source datasets (folders, ZIPs, shards) and the
VAE, and writing shard datasets (resumable by shard) from datasets or webdataset tar shards."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Iterator

import click
import numpy as np
import torch

from edm2.data.dataset import DatasetError, ImageFolderDataset
from edm2.data.shard_convert import convert_to_shards, encode_to_shards, source_index
from edm2.data.shards import ShardDataset, is_shard_dataset
from edm2.data.tar_source import TarSource, is_tar_source
from edm2.encoders import EncoderError, StabilityVAEEncoder
from edm2.runtime import distributed, files, locks


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
        for folder in files.stale_temporaries(dest.parent, name=dest.name, folders=True):
            click.echo(f"Left {click.format_filename(folder)}: a folder an interrupted dataset_tool.py may have "
                       f"written; delete it if nothing of yours is in it.")
        yield


def open_dataset(source: Path, suffix: str) -> ImageFolderDataset | ShardDataset:
    """A source dataset of .png (RGB) or .npy files (or shards of pixels or latents); problems name --source."""
    try:
        dataset = ShardDataset(source) if is_shard_dataset(source) else ImageFolderDataset(source)
    except DatasetError as e:
        raise click.BadParameter(str(e), param_hint="'--source'") from None
    if isinstance(dataset, ShardDataset):
        if dataset.encoding != ("pixels" if suffix == ".png" else "stability-vae"):
            raise click.BadParameter(f"{source} holds {dataset.encoding} shards, expected "
                                     f"{'pixels' if suffix == '.png' else 'latents'}", param_hint="'--source'")
    elif not dataset.fnames[0].lower().endswith(suffix):
        raise click.BadParameter(f"{source} holds {Path(dataset.fnames[0]).suffix} files, expected {suffix}",
                                 param_hint="'--source'")
    if suffix == ".png" and dataset.num_channels != 3:
        raise click.BadParameter(f"{source} holds {dataset.num_channels}-channel images, expected RGB",
                                 param_hint="'--source'")
    return dataset


def tar_only(source: Path, resolution: tuple[int, int] | None, transform: str | None) -> None:
    """Refuse --resolution/--transform where they would be ignored: for a source that is no tar shards."""
    if (resolution or transform) and not is_tar_source(source):
        raise click.UsageError(f"--resolution/--transform crop tar shards; {source} is a dataset, taken as it is "
                               f"(convert it to a ZIP at the resolution you want first)")


def is_shards(dest: Path) -> bool:
    """True for a --dest that names a shard dataset (NAME.shards)."""
    return dest.suffix.lower() == ".shards"


def open_shard_source(source: Path, transform_image: Callable[[np.ndarray], np.ndarray],
                      suffix: str) -> TarSource | ImageFolderDataset | ShardDataset:
    """The samples a shard dataset is made of: webdataset tar shards (transformed), else a dataset as it is."""
    if not is_tar_source(source):
        return open_dataset(source, suffix)
    try:
        return TarSource(source, transform_image)
    except DatasetError as e:
        raise click.BadParameter(str(e), param_hint="'--source'") from None


def convert_shards(source: Path, dest: Path, transform_image: Callable[[np.ndarray], np.ndarray],
                   max_images: int | None, shard_size: int | None) -> None:
    """convert into a shard dataset (resumable): from tar shards, or from a dataset (a ZIP's PNG or NPY files)."""
    with claimed_dest(dest, "convert"):
        samples = open_shard_source(source, transform_image, "")
        first = samples.pixels(0, 1)[0] if isinstance(samples, TarSource) else samples[0][0]
        encoding = "pixels" if first.dtype == np.uint8 else "stability-vae"
        index = source_index(samples, encoding, list(first.shape), {"source": str(source.resolve())}, max_images,
                             shard_size)
        convert_to_shards(samples, dest, index, report=click.echo)
    click.echo(f"wrote {index['count']} {encoding} samples of shape {'x'.join(map(str, first.shape))} to {dest}")


def encode_shards(source: Path, dest: Path, vae: str, batch: int, sizes: tuple[int | None, int | None],
                  transform_image: Callable[[np.ndarray], np.ndarray]) -> None:
    """encode into a latent shard dataset, over every process (resumable by shard); sizes: (--max-images,
    --shard-size)."""
    samples = open_shard_source(source, transform_image, ".png")
    encoder = load_vae(vae, batch)
    first = samples.pixels(0, 1) if isinstance(samples, TarSource) else samples[0][0][None]
    shape = list(encoder.encode_pixels(torch.from_numpy(first).to(distributed.device())).shape[1:])
    identity = {"source": str(source.resolve()), "vae": vae, "batch": batch}
    index = source_index(samples, "stability-vae", shape, identity, *sizes)
    encode_to_shards(samples, dest, index, encoder, batch, report=click.echo)
    if distributed.is_main():
        click.echo(f"wrote {index['count']} latents to {dest}")


def load_vae(vae: str, batch: int) -> StabilityVAEEncoder:
    """The encoder with its VAE loaded now, so that a VAE that cannot load fails before any work."""
    encoder = StabilityVAEEncoder(vae, batch_size=batch)
    try:
        encoder.init(distributed.device())
    except EncoderError as e:
        raise click.BadParameter(str(e), param_hint="'--vae'") from None
    return encoder
