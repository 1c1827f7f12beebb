"""What dataset_tool.py's commands share: a claimed destination, source datasets (folders, ZIPs, shards), the
encoder of --encoding and --encoding-settings, and writing shard datasets (resumable by shard) from datasets, images
or webdataset tar shards."""

from __future__ import annotations

import contextlib
import inspect
import os
from pathlib import Path
from typing import Callable, Iterator

import click
import numpy as np
import torch

from edm2.data.convert import ConvertedSamples
from edm2.data.dataset import DatasetError, ImageFolderDataset
from edm2.data.shard_convert import convert_to_shards, encode_to_shards, source_index
from edm2.data.shards import ShardDataset, has_captions, is_shard_dataset
from edm2.data.tar_source import TarSource, is_tar_source
from edm2.encoders import (ENCODINGS, LATENTS, PIXELS, RELEASE_ENCODINGS, Encoder, EncoderError, EncoderSettingsError,
                           encoder_for_dataset)
from edm2.errors import one_line
from edm2.runtime import bounded_json, distributed, files, locks

MAX_SETTINGS_BYTES = 1 << 16


class EncodingSettings(click.ParamType):
    """--encoding-settings: a JSON object of the encoding's constructor arguments, within bounded_json's bounds."""

    name = "JSON"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> dict:
        if isinstance(value, dict):
            return value
        try:
            settings = bounded_json.parse(str(value), "JSON", max_bytes=MAX_SETTINGS_BYTES)
        except bounded_json.JSONFileError as e:
            self.fail(str(e), param, ctx)
        if not isinstance(settings, dict):
            self.fail(f"expected a JSON object of settings, e.g. '{{\"gamma\": 1.8}}', not a "
                      f"{type(settings).__name__}", param, ctx)
        return settings


def encodings_storing(dtype: str) -> list[str]:
    """The names of ENCODINGS whose datasets store samples of dtype (PIXELS or LATENTS)."""
    return [name for name, cls in ENCODINGS.items() if cls.stored_dtype == dtype]


def make_encoder(encoding: str, settings: dict, param_hint: str = "'--encoding-settings'") -> Encoder:
    """The encoder of --encoding with --encoding-settings, checked by its own constructor before any work."""
    cls = ENCODINGS[encoding]
    try:
        return cls(**settings)
    except (TypeError, EncoderSettingsError) as e:
        takes = [name for name in inspect.signature(cls.__init__).parameters if name not in ("self", *cls.run_settings)]
        raise click.BadParameter(f"--encoding={encoding}: {one_line(e)} (it takes "
                                 f"{', '.join(takes) or 'no settings'})", param_hint=param_hint) from None


def ready(encoder: Encoder, param_hint: str) -> Encoder:
    """The encoder with what it needs loaded now (a VAE), so that one that cannot load fails before any work."""
    try:
        encoder.init(distributed.device())
    except EncoderError as e:
        raise click.BadParameter(str(e), param_hint=param_hint) from None
    return encoder


def recorded_encoding(dataset: ImageFolderDataset | ShardDataset, dtype: str, source: Path) -> dict:
    """What a source dataset records that it holds (Encoder.dataset_record's form), checked against the table and
    its samples' dtype; for one that records none, the release's rule (RELEASE_ENCODINGS)."""
    if dataset.encoding is None and dtype in RELEASE_ENCODINGS:
        return {"encoding": RELEASE_ENCODINGS[dtype].encoding}
    if dataset.encoding is None:
        raise click.BadParameter(f"{source} holds {dtype} samples and records no encoding", param_hint="'--source'")
    try:
        encoder = encoder_for_dataset(dataset.encoding, dataset.encoding_settings)
    except EncoderSettingsError as e:
        raise click.BadParameter(f"{source}: {dataset.record_file}: {e}", param_hint="'--source'") from None
    if encoder.stored_dtype != dtype:
        raise click.BadParameter(f"{source}: {dataset.record_file} records {dataset.encoding!r}, which stores "
                                 f"{encoder.stored_dtype}, but its samples are {dtype}", param_hint="'--source'")
    return encoder.dataset_record()


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
        stored = ENCODINGS[dataset.encoding].stored_dtype
        if suffix and stored != (PIXELS if suffix == ".png" else LATENTS):
            raise click.BadParameter(f"{source} holds {dataset.encoding} shards ({stored}), expected "
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
                      suffix: str, **reading) -> TarSource | ImageFolderDataset | ShardDataset:
    """The samples a shard dataset is made of: webdataset tar shards (transformed, their transparency and classes as
    reading's alpha, background and label_map say: TarSource's), else a dataset as it is."""
    if not is_tar_source(source):
        return open_dataset(source, suffix)
    try:
        return TarSource(source, transform_image, **reading)
    except DatasetError as e:
        raise click.BadParameter(str(e), param_hint="'--source'") from None


def convert_shards(source: Path, dest: Path, transform_image: Callable[[np.ndarray], np.ndarray],
                   max_images: int | None, shard_size: int | None, encoder: Encoder | None,
                   images: Callable[[], ConvertedSamples] | None = None, **reading) -> tuple[int | None, int] | None:
    """convert into a shard dataset (resumable): from tar shards (reading: TarSource's alpha, background and
    label_map) or from images (images() opens them: a folder or ZIP of images read as convert reads them; reading:
    how, kept in the shards' identity), in the encoding given (pixels by default), or from a dataset (a ZIP's PNG or
    NPY files), in the encoding it records. For tar shards and images, returns (the images written, None when
    resumed; how many of this run's had transparent pixels); None for a dataset."""
    with claimed_dest(dest, "convert"):
        samples = images() if images is not None else open_shard_source(source, transform_image, "", **reading)
        read = isinstance(samples, (TarSource, ConvertedSamples))  # samples made here, not a dataset's as they are
        first = samples.pixels(0, 1)[0] if read else samples[0][0]
        if read:
            encoding = (encoder or RELEASE_ENCODINGS[PIXELS]()).dataset_record()
        elif encoder is not None:
            raise click.BadParameter(f"{source} is a dataset: its shards keep the encoding it records",
                                     param_hint="'--encoding'")
        else:
            encoding = recorded_encoding(samples, str(first.dtype), source)
        identity = {"source": str(source.resolve()), **({"reading": reading} if images is not None else {})}
        index = source_index(samples, encoding, list(first.shape), identity, max_images, shard_size)
        resumed = convert_to_shards(samples, dest, index, report=click.echo)
    click.echo(f"wrote {index['count']} {index['encoding']} samples of shape {'x'.join(map(str, first.shape))}"
               f"{' with their captions' if has_captions(index) else ''} to {dest}")
    if not read:
        return None
    # A resumed run reads only the shards it writes (and the first image, for its shape).
    return None if resumed else index["count"], len(samples.transparent)


def encode_shards(samples: TarSource | ImageFolderDataset | ShardDataset, source: Path, dest: Path,
                  encoder: Encoder, batch: int, sizes: tuple[int | None, int | None]) -> None:
    """encode the samples of --source (open_shard_source's) into a latent shard dataset of the encoder's encoding,
    over every process (resumable by shard); sizes: (--max-images, --shard-size)."""
    first = samples.pixels(0, 1) if isinstance(samples, TarSource) else samples[0][0][None]
    shape = list(encoder.encode_pixels(torch.from_numpy(first).to(distributed.device())).shape[1:])
    identity = {"source": str(source.resolve()), "batch": batch}
    index = source_index(samples, encoder.dataset_record(), shape, identity, *sizes)
    encode_to_shards(samples, dest, index, encoder, batch, report=click.echo)
    if distributed.is_main():
        click.echo(f"wrote {index['count']} {index['encoding']} latents to {dest}")
