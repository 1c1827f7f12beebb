"""Prepare datasets in the release format: convert images, encode them to VAE latents, decode, make a toy set."""

from __future__ import annotations

import cli.wait_policy  # noqa: F401  first: PyTorch's OpenMP reads its wait policy once, when it loads
import functools
import os
import sys
from pathlib import Path
from typing import Callable

import click
import numpy as np
from tqdm import tqdm

from cli.command import Group
from cli.datasets import (EncodingSettings, claimed_dest, convert_shards, encode_shards, encodings_storing, is_shards,
                          make_encoder, open_dataset, open_shard_source, ready, recorded_encoding, tar_only)
from cli.run_setup import choose_encoder
from cli.types import MAX_SEED_OPTION, Integer, Resolution
from edm2.data.captions import caption_or_none
from edm2.data.convert import (ALPHA_MODES, CHANNEL_MODES, ConvertedSamples, ImageSizeError, ImageSource,
                               UnreadableImageError, background_colour, choose_mode, convert_images, open_image_source,
                               read_label_map, with_alpha)
from edm2.data.dataset import DatasetError, image_fname, is_raw_image_folder
from edm2.data.dataset_files import MAX_IMAGE_PIXELS, FileTree
from edm2.data.sources import open_data
from edm2.data.dataset_writer import dataset_writer, png_bytes
from edm2.data.shards import is_shard_dataset
from edm2.data.tar_convert import convert_tar_images
from edm2.data.tar_source import is_tar_source
from edm2.data.text_data import text_fname
from edm2.data.text_encode import encode_text_dataset
from edm2.data.toy_shapes import (COLOURS, SHAPES, HoldOutError, caption_of, captioned_params, draw_toy,
                                  kept_colours, parse_hold_out, toy_params)
from edm2.data.transforms import TRANSFORMS, TransformError, make_transform
from edm2.data.vae_datasets import decoded_images, encode_dataset, label_of
from edm2.encoders import DEFAULT_VAE, LATENTS, PIXELS, Encoder, StandardRGBEncoder
from edm2.errors import EDM2Error, one_line, shown
from edm2.procedures.image_grid import save_png
from edm2.procedures.preview import class_counts, decoded_means, first_of_each_class, preview_grid, stored_pixels
from edm2.runtime import distributed, files
from edm2.runtime.limits import MAX_BATCH, MAX_IMAGES, MAX_WORKERS
from edm2.text_encoders import MAX_TOKENS, TextEncoderError, TokenLengthError, load_text_encoder

DEFAULT_ENCODE_BATCH = 8
DEFAULT_TEXT_BATCH = 64
MAX_TOY_RESOLUTION = 1024  # the toy shapes are for small models: 16 or 32 pixels
MAX_PER_CLASS = 64  # preview: images per class, one row of them


def transform_for(transform: str | None, resolution: tuple[int, int] | None) -> Callable[[np.ndarray], np.ndarray]:
    """The image -> image function of --transform and --resolution; bad combinations are usage errors."""
    if resolution is None and transform is not None:
        raise click.UsageError(f"--transform={transform} needs --resolution")
    try:
        return make_transform(transform, resolution)
    except TransformError as e:
        raise click.BadParameter(str(e), param_hint="'--resolution'") from None


def alpha_background(alpha: str, background: str | None) -> tuple[int, int, int]:
    """--background's colour (white by default); refused unless --alpha=composite uses it."""
    if background is not None and alpha != "composite":
        raise click.BadParameter(f"is used by --alpha=composite only (--alpha={alpha})", param_hint="'--background'")
    try:
        return background_colour(background or "white")
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--background'") from None


def label_map_of(labels_path: Path | None) -> dict[str, int] | None:
    """The --labels map ({class name: class}), if given."""
    try:
        return None if labels_path is None else read_label_map(labels_path)
    except (EDM2Error, OSError) as e:
        raise click.BadParameter(one_line(e), param_hint="'--labels'") from None


def image_source(source: Path, labels_path: Path | None) -> ImageSource:
    """convert's source images, labeled by their folders (numbered by the --labels map if given)."""
    if is_shard_dataset(source):  # its samples are no image files: they convert as they are, into shards
        raise click.BadParameter(f"{source} is a shard dataset, which converts into shards (--dest=NAME.shards); "
                                 f"train_edm2.py and calculate_metrics.py read it as it is", param_hint="'--source'")
    label_map = label_map_of(labels_path)
    try:
        return open_image_source(source, label_map)
    except DatasetError as e:
        raise click.BadParameter(str(e), param_hint="'--source'" if label_map is None else "'--labels'") from None


def report_skip(name: str, reason: str) -> None:
    """convert --on-error=skip: say which image is left out and why."""
    tqdm.write(f"skipping {shown(name)}: cannot read it ({shown(reason)})", file=sys.stderr)


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
    python dataset_tool.py convert --source=datasets/img512-sd.zip --dest=datasets/img512-sd.shards
    torchrun --nproc_per_node=8 dataset_tool.py encode-text --source=datasets/coco512-sd.zip \\
        --dest=datasets/coco512-sd-t5.zip --text-encoder=models/t5-v1_1-xxl
    """


@main.command()
@click.option("--source", required=True, type=click.Path(exists=True, path_type=Path),
              help="Folder (class sub-folders give labels; dataset.json is honoured) or ZIP of images, or webdataset "
              "tar shards (a .tar or a folder of them).")
@click.option("--dest", required=True, type=click.Path(path_type=Path), help="Output .zip or directory.")
@click.option("--resolution", type=Resolution(), help="Output size N or WxH (WxH only for center-crop-wide).")
@click.option("--transform", type=click.Choice(TRANSFORMS), help="Crop/resize mode (needs --resolution).")
@click.option("--max-images", type=Integer(1, MAX_IMAGES), help="Convert only the first N images.")
@click.option("--on-error", type=click.Choice(["stop", "skip"]), default="stop", show_default=True,
              help="What to do with an image that cannot be read.")
@click.option("--workers", default=min(8, os.cpu_count() or 1), show_default=True, type=Integer(0, MAX_WORKERS),
              help="Processes reading and cropping images.")
@click.option("--shard-size", type=Integer(1, MAX_IMAGES), help="Shard destinations: samples per shard (the unit of "
              "a resumed write)  [default: about 256 MiB of samples]")
@click.option("--channels", type=click.Choice(list(CHANNEL_MODES)), default="auto", show_default=True,
              help="PNG channels: 1 (grayscale), 3 (RGB), or auto: 1 when every source image is grayscale, else 3.")
@click.option("--encoding", type=click.Choice(encodings_storing(PIXELS)), help="What the network sees of the PNGs, "
              "recorded in dataset.json (edm2.encoders.ENCODINGS)  [default: pixels; shards of a dataset: the one "
              "it records]")
@click.option("--encoding-settings", type=EncodingSettings(), default="{}", help="The encoding's settings (its "
              "constructor's arguments) as a JSON object, recorded with it, e.g. '{\"gamma\": 1.8}' for linear-rgb")
@click.option("--alpha", type=click.Choice(ALPHA_MODES), default="drop", show_default=True,
              help="Transparency: drop it (the colours it hid show, often black), keep it as one more channel "
                   "(RGBA; LA for grayscale), or composite the images onto --background.")
@click.option("--labels", "labels_path", metavar="JSON|DATASET", type=click.Path(exists=True, path_type=Path),
              help="Class numbers for the class folders: a JSON map {folder: class}, or the map of a dataset, its "
                   "dataset.json or a run's training_options.json  [default: sorted folder order from 0]")
@click.option("--background", metavar="white|black|#rrggbb", help="Colour behind transparent pixels for "
              "--alpha=composite  [default: white]")
def convert(source: Path, dest: Path, resolution: tuple[int, int] | None, transform: str | None,
            max_images: int | None, on_error: str, workers: int, shard_size: int | None, channels: str,
            encoding: str | None, encoding_settings: dict, alpha: str, labels_path: Path | None,
            background: str | None) -> None:
    """Crop/resize a folder, ZIP or tar shards of images into a dataset of PNGs or shards (--dest=NAME.shards).

    Into shards (resumable by shard in DEST.partial/), a folder or ZIP of images is read as into a PNG dataset
    (every option but --on-error=skip applies), a dataset keeps its PNG or NPY samples as they are (in the encoding
    it records), and webdataset tar shards (a .tar or a folder of them) are read as into a PNG dataset.

    Image i of the sorted source list becomes NNNNN/imgIIIIIIII.png (NNNNN = i // 1000); a
    skipped image leaves its index unused. Nothing is written unless the whole run succeeds.
    Top-level class folders (symbolic links followed) give the labels, numbered in sorted folder order or as
    --labels maps them (printed at the end, and kept in dataset.json's "classes").
    Captions, kept with the images, come from a metadata.jsonl ({"file_name": ..., "text": ...} a line), a NAME.txt
    beside each image, a tar sample's txt (else its json's "text", else "caption") or a dataset's own (docs/text.md).
    Grayscale sources (every image in PIL mode 1, L, LA, I or F) stay one-channel unless --channels=3;
    with any colour image among them all become RGB. Transparency is dropped unless --alpha says otherwise; the
    count of images that had transparent pixels is printed.

    \b
    python dataset_tool.py convert --source=imagenet/train --dest=datasets/img64.zip \\
        --resolution=64 --transform=center-crop-dhariwal
    """
    encoder = make_encoder(encoding or "pixels", encoding_settings) if encoding or encoding_settings else None
    colour = alpha_background(alpha, background)
    tar = is_tar_source(source)
    if tar and channels != "auto":
        raise click.BadParameter(f"{source} is tar shards, whose images become RGB", param_hint="'--channels'")
    label_map = label_map_of(labels_path) if tar else None
    if is_shards(dest):
        reading, images = dict(alpha=alpha, background=colour), None
        if not tar and raw_images(source):
            if on_error == "skip":
                raise click.BadParameter("a shard dataset numbers its samples without gaps; convert to a PNG dataset "
                                         "to leave unreadable images out", param_hint="'--on-error'")
            images = functools.partial(converted_samples, source, labels_path, transform_for(transform, resolution),
                                       max_images, channels, dict(reading, workers=workers))
            # How the images are read, kept in their shards' identity: a rerun with other options starts afresh.
            reading.update(channels=channels, labels=label_map_of(labels_path), resolution=resolution,
                           transform=transform)
        elif not tar:
            tar_only(source, resolution, transform)
            if alpha != "drop" or labels_path is not None:
                raise click.BadParameter("a shard dataset of a dataset holds its samples and labels as they are; "
                                         "convert to a PNG dataset for --alpha or --labels", param_hint="'--dest'")
        else:
            reading["label_map"] = label_map
        with distributed.session(single_process=True):
            try:
                counts = convert_shards(source, dest, transform_for(transform, resolution), max_images, shard_size,
                                        encoder, images, **reading)
            except UnreadableImageError as e:
                raise click.ClickException(f"{e}; a shard dataset has no gaps: convert to a PNG dataset with "
                                           f"--on-error=skip to leave such images out") from None
            except ImageSizeError as e:
                raise click.ClickException(f"{e}; use --resolution and --transform to make them square and "
                                           f"equal") from None
        if counts is not None:
            report_transparency(*counts, alpha, colour)
        return
    if tar:
        return convert_tar(source, dest, transform_for(transform, resolution), max_images, encoder,
                           dict(alpha=alpha, background=colour, label_map=label_map))
    with distributed.session(single_process=True), claimed_dest(dest, "convert"):
        transform_image = transform_for(transform, resolution)
        images = image_source(source, labels_path)
        mode = choose_mode(images, channels, max_images)
        with dataset_writer(dest) as writer:
            writer.encoding = (encoder or StandardRGBEncoder()).dataset_record()
            try:
                written, transparent = convert_images(images, writer, transform_image, max_images, workers,
                                                      on_skip=report_skip if on_error == "skip" else None, mode=mode,
                                                      alpha=alpha, background=colour)
            except UnreadableImageError as e:
                raise click.ClickException(f"{e}; --on-error=skip leaves such images out") from None
            except ImageSizeError as e:
                raise click.ClickException(f"{e}; use --resolution and --transform to make them square and "
                                           f"equal") from None
    report_converted(dest, written, len(images.names[:max_images]) - written,
                     with_alpha(mode) if alpha == "keep" else mode, transparent, alpha, colour, images.classes,
                     images.captions is not None)


def convert_tar(source: Path, dest: Path, transform_image: Callable[[np.ndarray], np.ndarray],
                max_images: int | None, encoder: Encoder | None, reading: dict) -> None:
    """convert webdataset tar shards into a dataset of PNGs: transformed, their transparency and classes as reading
    (TarSource's alpha, background and label_map) says."""
    with distributed.session(single_process=True), claimed_dest(dest, "convert"):
        samples = open_shard_source(source, transform_image, "", **reading)
        with dataset_writer(dest) as writer:
            writer.encoding = (encoder or StandardRGBEncoder()).dataset_record()
            writer.classes = samples.classes
            written, transparent = convert_tar_images(samples, writer, max_images)
    alpha = reading["alpha"]
    report_converted(dest, written, 0, "RGBA" if alpha == "keep" else "RGB", transparent, alpha, reading["background"],
                     samples.classes, samples.captions is not None)


def raw_images(source: Path) -> bool:
    """True for a folder or ZIP of images that is no dataset yet (edm2.data.dataset.is_raw_image_folder), which
    convert reads as it reads them into a PNG dataset; a source that is no folder or ZIP is left to open_dataset."""
    if is_shard_dataset(source):
        return False
    try:
        return is_raw_image_folder(FileTree(source))
    except DatasetError:
        return False


def converted_samples(source: Path, labels_path: Path | None, transform_image: Callable[[np.ndarray], np.ndarray],
                      max_images: int | None, channels: str, reading: dict) -> ConvertedSamples:
    """convert's source images (labeled by their folders or --labels) read for shards as into a PNG dataset: in
    --channels's mode, transformed, their transparency as reading (ConvertedSamples's alpha and background) says,
    in its workers."""
    images = image_source(source, labels_path)
    return ConvertedSamples(images, transform_image, max_images, choose_mode(images, channels, max_images), **reading)


def report_converted(dest: Path, written: int, skipped: int, mode: str, transparent: int, alpha: str,
                     colour: tuple[int, int, int], classes: dict[str, int] | None, captioned: bool = False) -> None:
    """convert's closing lines: what it wrote (and whether with captions), what it did with transparency, and the
    classes."""
    kind = {"L": "grayscale (1 channel)", "RGB": "RGB", "LA": "grayscale+alpha (2 channels)", "RGBA": "RGBA (4 channels)"}
    click.echo(f"wrote {written} {kind[mode]} images{' with their captions' if captioned else ''} to {shown(dest)}"
               + (f" ({skipped} skipped)" if skipped else ""))
    report_transparency(written, transparent, alpha, colour)
    if classes:
        click.echo("classes (dataset.json's numbers and names):")
        for folder, label in sorted(classes.items(), key=lambda item: item[1]):
            click.echo(f"  {label}: {shown(folder)}")


def report_transparency(written: int | None, transparent: int, alpha: str, colour: tuple[int, int, int]) -> None:
    """The line saying how many of the written images (None: of a resumed run's) had transparent pixels and what
    became of them; nothing when none had."""
    if transparent:
        click.echo(f"{transparent} of {'the' if written is None else written} images had transparent pixels: " + {
            "drop": "their alpha was dropped, so the colours it hid show (often black); --alpha=composite "
                    "--background=white puts them on a colour, --alpha=keep keeps it as a channel",
            "keep": "their alpha is kept as the last channel",
            "composite": "composited onto #{:02x}{:02x}{:02x}".format(*colour)}[alpha])


def vae_options(command: Callable) -> Callable:
    """The --vae, --batch and --max-images options of encode and decode."""
    for option in reversed([
        click.option("--vae", help="diffusers AutoencoderKL: hub name or local directory (the encoding's vae_name)  "
                     f"[default: the encoding's, {DEFAULT_VAE} for stability-vae]"),
        click.option("--batch", default=DEFAULT_ENCODE_BATCH, show_default=True, type=Integer(1, MAX_BATCH),
                     help="Images per VAE call (per process)."),
        click.option("--max-images", type=Integer(1, MAX_IMAGES), help="Process only the first N images."),
    ]):
        command = option(command)
    return command


def vae_encoder(encoding: str, settings: dict, vae: str | None, batch: int, param_hint: str) -> Encoder:
    """The encoder of a VAE encoding with its settings, --vae (its vae_name, if given) and --batch (its batch_size)."""
    return make_encoder(encoding, dict(settings, **({"vae_name": vae} if vae is not None else {}), batch_size=batch),
                        param_hint)


def vae_hint(vae: str | None, otherwise: str = "'--encoding-settings'") -> str:
    """The option that named the VAE, for a VAE that cannot load: --vae when given."""
    return "'--vae'" if vae is not None else otherwise


@main.command()
@click.option("--source", required=True, type=click.Path(exists=True, path_type=Path),
              help="Dataset of RGB PNGs (directory or ZIP), e.g. from convert.")
@click.option("--dest", required=True, type=click.Path(path_type=Path), help="Output .zip or directory.")
@vae_options
@click.option("--encoding", type=click.Choice(encodings_storing(LATENTS)), default="stability-vae", show_default=True,
              help="The VAE encoding of the latents, recorded in dataset.json (edm2.encoders.ENCODINGS)")
@click.option("--encoding-settings", type=EncodingSettings(), default="{}", help="The encoding's settings (its "
              "constructor's arguments) as a JSON object, recorded with it, e.g. '{\"vae_name\": \"DIR\", "
              "\"latent_channels\": 16, \"raw_mean\": 0.0, \"raw_std\": 1.0}' for diffusers-vae")
@click.option("--workers", default=2, show_default=True, type=Integer(0, MAX_WORKERS),
              help="Data-loading processes per GPU process.")
@click.option("--shard-size", type=Integer(1, MAX_IMAGES), help="Shard destinations: samples per shard (the unit of "
              "a resumed write)  [default: about 256 MiB of samples]")
@click.option("--resolution", type=Resolution(), help="Tar sources: output size N (before encoding).")
@click.option("--transform", type=click.Choice(TRANSFORMS), help="Tar sources: crop/resize mode (needs --resolution).")
def encode(source: Path, dest: Path, vae: str | None, batch: int, max_images: int | None, encoding: str,
           encoding_settings: dict, workers: int, shard_size: int | None, resolution: tuple[int, int] | None,
           transform: str | None) -> None:
    """Encode pixels into float32 VAE mean/std latents (NNNNN/img-mean-std-IIIIIIII.npy, or shards): 8 channels for
    the Stability VAE, twice the latent channels of another (--encoding=diffusers-vae).

    A --dest named NAME.shards gets a shard dataset (of the encoding and its settings); its source may also be
    webdataset tar shards (a .tar file or a folder of them), resized by --resolution
    and --transform. Progress is kept by shard in DEST.partial/ and resumed the same way.

    Under torchrun the images are split across processes. Progress is kept in DEST.partial/ (one
    file per image); running the same command again continues from there, and the finished dataset
    replaces the folder. The result does not depend on interruptions or the number of processes.

    \b
    torchrun --nproc_per_node=8 dataset_tool.py encode --source=datasets/img512.zip \\
        --dest=datasets/img512-sd.zip
    """
    tar_only(source, resolution, transform)
    for name, option in [("vae_name", "--vae"), ("batch_size", "--batch")]:
        if name in encoding_settings and (name == "batch_size" or vae is not None):
            raise click.BadParameter(f"gives {name}, which {option} gives", param_hint="'--encoding-settings'")
    encoder = vae_encoder(encoding, encoding_settings, vae, batch, "'--encoding-settings'")
    if is_shards(dest):
        with distributed.session(), claimed_dest(dest, "encode"):
            samples = open_shard_source(source, transform_for(transform, resolution), ".png")  # checked before the VAE
            ready(encoder, vae_hint(vae))
            return encode_shards(samples, source, dest, encoder, batch, (max_images, shard_size))
    if is_tar_source(source):
        raise click.BadParameter(f"{source}: tar shards encode into shards: --dest=NAME.shards", param_hint="'--dest'")
    with distributed.session(), claimed_dest(dest, "encode"):
        dataset = open_dataset(source, ".png")
        count = min(len(dataset), max_images or len(dataset))
        manifest = {"source": str(source.resolve()), "images": count, "image_shape": dataset.image_shape,
                    "encoding": encoder.dataset_record()}
        ready(encoder, vae_hint(vae))  # before the progress folder exists
        encode_dataset(dataset, dest, encoder, count, batch, workers, manifest, report=click.echo)
        if distributed.is_main():
            click.echo(f"wrote {count} latents to {dest}")


@main.command("encode-text")
@click.option("--source", required=True, type=click.Path(exists=True, path_type=Path),
              help="Dataset with captions (directory or ZIP of PNGs or latents).")
@click.option("--dest", required=True, type=click.Path(path_type=Path), help="Output .zip or directory.")
@click.option("--text-encoder", required=True, metavar="ID_OR_DIR", help="transformers T5 encoder or CLIP text model: "
              "a folder saved by save_pretrained, or a hub ID (downloaded into transformers' cache).")
@click.option("--tokens", type=Integer(1, MAX_TOKENS), help="Tokens per caption (longer ones are truncated)  "
              "[default: 128 for T5, 77 for CLIP]")
@click.option("--batch", default=DEFAULT_TEXT_BATCH, show_default=True, type=Integer(1, MAX_BATCH),
              help="Captions per encoder call (per process).")
def encode_text(source: Path, dest: Path, text_encoder: str, tokens: int | None, batch: int) -> None:
    """Cache each caption's text embeddings (float16 NNNNN/txtIIIIIIII.npy: pooled row, then the tokens) in a copy
    of the dataset, with the encoder's identity, the token lengths and the empty caption's embeddings.

    Under torchrun the captions are split across processes. Progress is kept in DEST.partial/ (one
    file per caption, one per finished batch); running the same command again continues from there.
    The result does not depend on interruptions or the number of processes.

    \b
    torchrun --nproc_per_node=8 dataset_tool.py encode-text --source=datasets/coco512-sd.zip \\
        --dest=datasets/coco512-sd-t5.zip --text-encoder=models/t5-v1_1-xxl
    """
    if is_shards(dest):
        raise click.BadParameter("encode-text writes a folder or ZIP dataset; shard datasets hold no text "
                                 "embeddings yet", param_hint="'--dest'")
    if is_shard_dataset(source) or is_tar_source(source):
        raise click.BadParameter(f"{source} is shards; encode-text reads a folder or ZIP dataset (dataset_tool.py "
                                 f"convert makes one)", param_hint="'--source'")
    with distributed.session(), claimed_dest(dest, "encode-text"):
        dataset = open_dataset(source, "")
        if not dataset.has_captions:
            raise click.BadParameter(f"{source} has no captions (its dataset.json records none)",
                                     param_hint="'--source'")
        try:
            for name in dataset.fnames:
                text_fname(name)
            encoder = load_text_encoder(text_encoder, tokens, distributed.device())
        except TokenLengthError as e:
            raise click.BadParameter(str(e), param_hint="'--tokens'") from None
        except TextEncoderError as e:
            raise click.BadParameter(str(e), param_hint="'--text-encoder'") from None
        except DatasetError as e:
            raise click.BadParameter(f"{source}: {e}", param_hint="'--source'") from None
        truncated = encode_text_dataset(dataset, source, dest, encoder, batch, report=click.echo)
        if distributed.is_main():
            if truncated:
                click.echo(f"{truncated} of {len(dataset)} captions were longer than {encoder.tokens} tokens and were "
                           f"truncated to their first {encoder.tokens} (--tokens)")
            click.echo(f"wrote {len(dataset)} caption embeddings ({encoder.tokens} tokens of {encoder.dim}) to {dest}")


@main.command()
@click.option("--source", required=True, type=click.Path(exists=True, path_type=Path),
              help="Latent dataset of mean/std .npy files (directory or ZIP).")
@click.option("--dest", required=True, type=click.Path(path_type=Path), help="Output .zip or directory of PNGs.")
@vae_options
def decode(source: Path, dest: Path, vae: str | None, batch: int, max_images: int | None) -> None:
    """Decode the mean of each stored latent back to a PNG, to look at a latent dataset, by the VAE encoding it
    records (--vae another VAE).

    \b
    python dataset_tool.py decode --source=datasets/img512-sd.zip --dest=out/decoded --max-images=100
    """
    with distributed.session(single_process=True), claimed_dest(dest, "decode"):
        dataset = open_dataset(source, ".npy")
        if dataset.num_channels % 2:
            raise click.BadParameter(f"{source} has {dataset.num_channels} channels; mean/std latents have an "
                                     f"even count", param_hint="'--source'")
        count = min(len(dataset), max_images or len(dataset))
        record = recorded_encoding(dataset, LATENTS, source)
        encoder = vae_encoder(record["encoding"], record.get("encoding_settings", {}), vae, batch, "'--source'")
        if not hasattr(encoder, "decode_raw"):
            raise click.BadParameter(f"{source} records {record['encoding']!r}, no VAE encoding that decodes raw "
                                     f"latents", param_hint="'--source'")
        ready(encoder, vae_hint(vae, "'--source'"))
        with dataset_writer(dest) as writer:
            writer.encoding = StandardRGBEncoder().dataset_record()
            for idx, image in tqdm(decoded_images(dataset, encoder, count, batch, distributed.device()),
                                   total=count, desc="decode", unit="img"):
                writer.add(image_fname(idx), png_bytes(image), label_of(dataset, idx), caption_or_none(dataset, idx))
    click.echo(f"wrote {count} images to {dest}")


@main.command()
@click.option("--dest", required=True, type=click.Path(path_type=Path), help="Output .zip or directory.")
@click.option("--resolution", default=32, show_default=True, type=Integer(8, MAX_TOY_RESOLUTION), help="Image size.")
@click.option("--num", default=10000, show_default=True, type=Integer(1, MAX_IMAGES), help="Number of images.")
@click.option("--classes", default=6, show_default=True, type=Integer(1, len(SHAPES)),
              help=f"Number of shape classes, at most {len(SHAPES)}: {', '.join(SHAPES)}.")
@click.option("--seed", default=0, show_default=True, type=Integer(0, MAX_SEED_OPTION), help="Random seed.")
@click.option("--captions", is_flag=True, help="Caption every image \"a COLOUR SHAPE on the SIDE\" (dataset.json's "
              "\"captions\"), colours clearly one of " + ", ".join(COLOURS) + ", shapes clearly left or right.")
@click.option("--hold-out", metavar="COLOUR:SHAPE,...", help="With --captions: colour/shape pairs that no image "
              "shows (e.g. red:square,blue:circle), to test prompts never seen in training.")
def toy(dest: Path, resolution: int, num: int, classes: int, seed: int, captions: bool, hold_out: str | None) -> None:
    """Make a labeled dataset of coloured shapes (class = shape) that a small model learns quickly on a CPU.

    Image i shows shape i % classes; its colour, size and position come from the seed and i alone. With
    --captions, each image also has a caption saying its colour (the hue's sextant: red covers hues [-30, 30)
    degrees, yellow [30, 90), and so on), its shape and the side of its centre; --hold-out leaves the colour/shape
    pairs it names out (their images are drawn in the shape's other colours).

    \b
    python dataset_tool.py toy --dest=datasets/toy32.zip --resolution=32 --num=10000 --classes=6
    python dataset_tool.py toy --dest=datasets/toy16-text.zip --resolution=16 --captions --hold-out=red:square
    """
    kinds = list(SHAPES)[:classes]
    if hold_out is not None and not captions:
        raise click.BadParameter("holds out caption combinations: give --captions too", param_hint="'--hold-out'")
    try:
        held_out = parse_hold_out(hold_out, kinds) if hold_out is not None else frozenset()
    except HoldOutError as e:
        raise click.BadParameter(str(e), param_hint="'--hold-out'") from None
    with distributed.session(single_process=True):
        with claimed_dest(dest, "toy"), dataset_writer(dest) as writer:
            writer.encoding = StandardRGBEncoder().dataset_record()
            for idx in tqdm(range(num), desc="toy", unit="img"):
                shape, rng = kinds[idx % classes], np.random.default_rng([seed, idx])
                params = (captioned_params(shape, resolution, rng, kept_colours(shape, held_out)) if captions
                          else toy_params(shape, resolution, rng))
                writer.add(image_fname(idx), png_bytes(draw_toy(params)), idx % classes,
                           caption_of(params) if captions else None)
    held = f", holding out {', '.join(f'{c}:{s}' for c, s in sorted(held_out))}" if held_out else ""
    click.echo(f"wrote {num} {'captioned ' if captions else ''}images of {classes} classes ({', '.join(kinds)}) to "
               f"{dest}{held}")


@main.command()
@click.option("--data", required=True, help="A dataset as train_edm2.py --data reads it: folder, ZIP, shards or "
              "a blend.")
@click.option("--dest", required=True, type=click.Path(dir_okay=False, path_type=Path), help="The PNG to write.")
@click.option("--per-class", default=8, show_default=True, type=Integer(1, MAX_PER_CLASS),
              help="Images per class: the first of each, one row per class.")
@click.option("--batch", default=DEFAULT_ENCODE_BATCH, show_default=True, type=Integer(1, MAX_BATCH),
              help="Images per VAE call, for latents.")
def preview(data: str, dest: Path, per_class: int, batch: int) -> None:
    """Write a grid of the first images of each class (one row per class; latents decoded by the VAE encoding the
    dataset records) to one PNG, and print how many images each class has.

    \b
    python dataset_tool.py preview --data=datasets/toy32.zip --dest=out/toy32-preview.png --per-class=8
    """
    if dest.suffix.lower() != ".png":
        raise click.BadParameter(f"{shown(dest)} is no .png file name", param_hint="'--dest'")
    files.check_writable_dir(dest.parent)
    with distributed.session(single_process=True):
        try:
            dataset = open_data(data)
        except DatasetError as e:
            raise click.BadParameter(one_line(e), param_hint="'--data'") from None
        encoder = choose_encoder(dataset)
        if encoder.stored_dtype != PIXELS and not hasattr(encoder, "decode_raw"):
            raise click.BadParameter(f"{data} records {dataset.encoding!r}, no VAE encoding that decodes its latents",
                                     param_hint="'--data'")
        decode = stored_pixels if encoder.stored_dtype == PIXELS else functools.partial(
            decoded_means, ready(encoder, "'--data'"), distributed.device())
        counts = class_counts(dataset)
        height, width = decode(dataset[0][0][None]).shape[2:]  # a VAE's images are larger than its latents
        pixels = (len(counts) * (height + 1) - 1) * (per_class * (width + 1) - 1)
        if pixels > MAX_IMAGE_PIXELS:
            raise click.BadParameter(f"{len(counts)} classes of {per_class} images of {width}x{height} make a grid of "
                                     f"{pixels:,} pixels, beyond the {MAX_IMAGE_PIXELS:,} of an image our tools read",
                                     param_hint="'--per-class'")
        grid = preview_grid(dataset, first_of_each_class(dataset, counts, per_class), per_class, decode, batch)
        save_png(dest, grid)
    names = {label: name for name, label in (dataset.classes or {}).items()}
    for label, count in counts.items():
        what = "all" if label is None else f"class {label}" + (f" ({shown(names[label])})" if label in names else "")
        click.echo(f"  {what}: {count} images")
    click.echo(f"wrote a preview of {sum(counts.values())} images in {len(counts)} class(es), {per_class} of each, "
               f"to {shown(dest)}")


if __name__ == "__main__":
    main()
