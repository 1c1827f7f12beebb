"""train_edm2.py's run from its options: the data (checked for labels), the encoder the data records, and the network
of --arch and its family's options or of the --init snapshot, each refused in one line naming its option."""

from __future__ import annotations

import os

import click
from click.core import ParameterSource

from edm2 import families
from edm2.data.dataset import DatasetError, ImageData
from edm2.data.sources import open_data
from edm2.encoders import LATENTS, PIXELS, RELEASE_ENCODINGS, Encoder, EncoderSettingsError, encoder_for_dataset
from edm2.errors import SnapshotError, one_line
from edm2.formats.snapshot import read_metadata
from edm2.runtime import files
from training.architecture import (NetworkMisfit, check_family_fits_data, check_init, check_network_fits_data,
                                   differs_from_preset, effective, init_path, network_options, read_init)
from training.presets import get_preset
from training.text_conditioning import text_description


def open_dataset(data: str, cond: bool) -> ImageData:
    """The training data, checked for labels (or text embeddings) when training a conditional model; with
    cond=False its labels and text embeddings are both left unused, for an unconditional model."""
    try:
        dataset = open_data(data, use_labels=cond, use_text=cond)
    except DatasetError as e:
        raise click.BadParameter(str(e), param_hint="--data") from None
    if cond and not dataset.has_labels and not dataset.has_text:
        raise click.UsageError(f"--cond=True but {data} has no labels (dataset.json); pass --cond=False")
    return dataset


def choose_encoder(dataset: ImageData) -> Encoder:
    """The encoder of the encoding the dataset records (dataset.json "encoding", edm2.encoders.ENCODINGS), its
    settings checked against the data's dtype and channels before any training work; for a dataset written by the
    release or an earlier version, which records none, the rule they imply (RELEASE_ENCODINGS, see
    unrecorded_encoding): StandardRGBEncoder for PNG data of any channel count, StabilityVAEEncoder for 8-channel
    mean/std latents."""
    image, _ = dataset[0]
    channels = dataset.num_channels
    if dataset.encoding is not None:
        try:
            encoder = encoder_for_dataset(dataset.encoding, dataset.encoding_settings)
            if encoder.stored_dtype != image.dtype:
                raise EncoderSettingsError(f"the encoding {dataset.encoding!r} stores {encoder.stored_dtype}, but the "
                                           f"samples are {image.dtype}")
            encoder.out_channels(channels)
        except EncoderSettingsError as e:
            raise click.BadParameter(f"{dataset.path}: {dataset.record_file}: {e} (encoding {dataset.encoding!r})",
                                     param_hint="--data") from None
        return encoder
    encoder = RELEASE_ENCODINGS[PIXELS if image.dtype == PIXELS else LATENTS]()
    if encoder.stored_dtype == PIXELS:
        return encoder
    if channels != 2 * len(encoder.scale):
        raise click.BadParameter(
            f"{dataset.path}: .npy latents have {channels} channel(s); expected {2 * len(encoder.scale)} "
            f"(mean and std of {len(encoder.scale)} VAE channels, `dataset_tool.py encode`)",
            param_hint="--data",
        )
    return encoder


def unrecorded_encoding(dataset: ImageData, encoder: Encoder) -> str | None:
    """The line that says a dataset records no encoding and which one its files imply; None when it records one."""
    if dataset.encoding is not None:
        return None
    return (f"{dataset.path}: dataset.json records no encoding (written by the release or an earlier version); "
            f"its {'PNG images' if encoder.stored_dtype == PIXELS else '.npy latents'} are taken as {encoder.encoding}")


def arch_network(preset: str, arch: str, dataset: ImageData, img_channels: int, channels: int | None,
                 given: dict) -> dict:
    """The network arguments of family --arch: the preset's (where they are of its family's hyperparameters) with the
    family's options given (cli.network_options); impossible ones are refused with a line that names the option.
    The U-Net's attention resolutions are held to its levels when one of these was typed on the command line or
    they shape it otherwise than the preset: a --config file that holds the preset's own (a run's
    training_options.json) leaves out those the data does not have, as the preset does."""
    channels = channels or get_preset(preset).channels
    source = click.get_current_context().get_parameter_source
    typed = any(value is not None and source(name) == ParameterSource.COMMANDLINE for name, value in given.items())
    try:
        network = network_options(get_preset(preset), given, arch)
        if arch == families.DEFAULT_FAMILY:
            check_network_fits_data(dataset.resolution, channels, network,
                                    explicit=typed or differs_from_preset(network, get_preset(preset).network))
        else:
            check_family_fits_data(dataset.resolution, img_channels, dataset.label_dim, channels, network)
    except NetworkMisfit as e:
        raise click.UsageError(str(e)) from None
    return network


def init_options(init: str, arch: str | None, dataset: ImageData, encoder: Encoder, given: dict,
                 preset: str | None = None, option: str = "--init") -> tuple[Encoder, dict]:
    """The snapshot's encoder, and its architecture as run options (channels, network, init); a snapshot that
    cannot load, or does not fit the data or the options given, is refused naming option (--init, or --teacher),
    one of another family than an --arch given naming --arch.

    Data labeled with some of the network's classes trains it with its labels as they are: the dataset's one-hot
    labels widen to the network's classes."""
    try:
        snapshot = read_init(init)
        check_init(snapshot, resolution=dataset.resolution, num_channels=dataset.num_channels,
                   label_dim=dataset.label_dim, encoder=encoder, given=given, preset=preset,
                   text=text_description(dataset).get("text_encoding"))
    except (SnapshotError, files.DownloadError, NetworkMisfit) as e:
        raise click.BadParameter(one_line(e), param_hint=option) from None
    theirs = snapshot.network.get("family", families.DEFAULT_FAMILY)
    if arch not in (None, theirs):
        raise click.BadParameter(f"{init} is a network of family {theirs!r}; leave --arch out to take it",
                                 param_hint="--arch")
    dataset.label_dim = snapshot.network_kwargs["label_dim"] if dataset.label_dim else 0
    return snapshot.encoder, dict(channels=snapshot.channels, network=snapshot.network, init=snapshot.path)


def run_network(preset: str, arch: str | None, init: str | None, dataset: ImageData, encoder: Encoder,
                given: dict, channels: int | None) -> tuple[Encoder, dict]:
    """The run's encoder and the options that say its network: from --arch (default: the preset's family) and its
    family's options, or from the --init snapshot."""
    if init is None:
        arch = arch or get_preset(preset).family
        img_channels = encoder.out_channels(dataset.num_channels)
        return encoder, dict(network=arch_network(preset, arch, dataset, img_channels, channels, given))
    return init_options(init, arch, dataset, encoder, dict(given, channels=channels), preset)


def teacher_options(teacher: str, arch: str | None, dataset: ImageData, encoder: Encoder, given: dict,
                    preset: str) -> tuple[Encoder, dict]:
    """init_options of a consistency model's --teacher, whose weights and network the student starts from; refused
    naming --teacher where it is a consistency model itself, or where the preset trains another network."""
    path = init_path(teacher)
    try:
        consistency = None if path.endswith(".pkl") else read_metadata(files.cached_path(path)).get("consistency")
    except (SnapshotError, files.DownloadError) as e:
        raise click.BadParameter(one_line(e), param_hint="--teacher") from None
    if consistency is not None:
        raise click.BadParameter(f"{os.path.basename(path)} is a consistency model itself (its metadata records "
                                 f"method {consistency.get('method')!r}); a teacher is a diffusion model",
                                 param_hint="--teacher")
    encoder, network = init_options(teacher, arch, dataset, encoder, given, preset, option="--teacher")
    recipe = get_preset(preset)
    kwargs = read_init(path).network_kwargs
    theirs = dict(channels=effective(kwargs, "model_channels"),
                  **{name: effective(kwargs, name) for name in recipe.hyperparameters})
    ours = dict(channels=recipe.channels, **{name: effective(recipe.hyperparameters, name)
                                             for name in recipe.hyperparameters})
    differing = [name for name in ours if ours[name] != theirs[name]]
    if differing:
        details = ", ".join(f"{name} {ours[name]} against {theirs[name]}" for name in differing)
        raise click.BadParameter(f"--preset={preset} trains another network than {os.path.basename(path)} "
                                 f"({details}); choose the preset of the teacher's network", param_hint="--teacher")
    return encoder, dict(network, teacher=network["init"])
