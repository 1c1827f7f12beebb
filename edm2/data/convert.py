"""Converting a folder or ZIP of images (any size, any format PIL reads) into a release-format dataset.

Images become RGB PNGs, or one-channel (L) PNGs for grayscale data (choose_mode); with alpha kept, RGBA or LA.
"""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path
from typing import Callable

import numpy as np
import PIL.Image
import torch
from tqdm import tqdm

from edm2.data.captions import read_dataset_captions, read_source_captions
from edm2.data.dataset import image_fname, source_image_names
from edm2.data.dataset_json import CLASSES_KEY, LABELS_FILE, parse_classes, read_dataset_json
from edm2.data.dataset_files import IMAGE_ERRORS, DatasetError, FileTree, open_image
from edm2.data.dataset_writer import DatasetWriter, png_bytes
from edm2.data.shards import is_shard_dataset, read_index
from edm2.errors import one_line, shown
from edm2.runtime import bounded_json


class UnreadableImageError(DatasetError):
    """A source image that PIL cannot read; the message names it."""


class ImageSizeError(DatasetError):
    """Source images that are not square, or not all of one size, after the transform."""


# convert --channels: 'auto' picks one channel when every source image is grayscale.
CHANNEL_MODES = {"auto": None, "1": "L", "3": "RGB"}
# convert --alpha: what becomes of transparency. drop: the colour channels as stored (what transparent pixels hide
# shows: often black); keep: one more channel (RGBA, or LA for grayscale); composite: blended onto a colour.
ALPHA_MODES = ("drop", "keep", "composite")
BACKGROUNDS = {"white": (255, 255, 255), "black": (0, 0, 0)}


def background_colour(text: str) -> tuple[int, int, int]:
    """An RGB colour from 'white', 'black' or '#rrggbb'; ValueError otherwise."""
    if text.lower() in BACKGROUNDS:
        return BACKGROUNDS[text.lower()]
    if len(text) == 7 and text[0] == "#" and all(c in "0123456789abcdefABCDEF" for c in text[1:]):
        return tuple(int(text[i:i + 2], 16) for i in (1, 3, 5))
    raise ValueError(f"{text!r} is no colour: use white, black or #rrggbb")


def with_alpha(mode: str) -> str:
    """The PIL mode of mode's channels plus alpha (L -> LA, RGB -> RGBA): convert --alpha=keep's output."""
    return {"L": "LA", "RGB": "RGBA"}[mode]


@dataclasses.dataclass
class ImageSource:
    """The images of a folder (recursively) or ZIP in sorted order, with their classes if it has any.

    classes maps class names to labels ({folder: label} when the labels come from folders, dataset.json's
    CLASSES_KEY when it has one); captions maps every image to its caption (edm2/data/captions.py: dataset.json's,
    or a metadata.jsonl's and NAME.txt files'), None when there are none.
    """

    files: FileTree
    names: list[str]
    labels: dict[str, int] | None
    classes: dict[str, int] | None = None
    captions: dict[str, str] | None = None

    @property
    def path(self) -> Path:
        """The folder or ZIP."""
        return self.files.path


def open_image_source(path: str | os.PathLike, label_map: dict[str, int] | None = None) -> ImageSource:
    """The images of path; classes (and captions) from its dataset.json if present, else from top-level folder
    names: numbered in sorted folder order, or as label_map ({folder: class}, read_label_map) gives them, and
    captions from its metadata.jsonl and NAME.txt files (read_source_captions)."""
    files = FileTree(path)
    names = source_image_names(files.names)
    if not names:
        raise DatasetError(f"{shown(path)} holds no images")
    if LABELS_FILE in files.names:  # read as every dataset's labels are
        if label_map is not None:
            raise DatasetError(f"{shown(path)} has its own {LABELS_FILE}, whose labels it keeps; a label map is for "
                               "class folders")
        labels, classes = read_dataset_json(files, names)
        captions = read_dataset_captions(files, names)
        return ImageSource(files, names, None if labels is None else dict(zip(names, labels)), classes,
                           None if captions is None else dict(zip(names, captions)))
    return ImageSource(files, names, *_folder_labels(names, label_map), read_source_captions(files, names))


def _folder_labels(names: list[str], label_map: dict[str, int] | None) -> tuple[dict[str, int] | None,
                                                                            dict[str, int] | None]:
    """One class per top-level folder (ImageNet's layout), numbered in sorted folder order or by label_map; none
    without folders (and without a label_map)."""
    folders = {name: name.split("/")[0] if "/" in name else "" for name in names}
    found = sorted(set(folders.values()))
    if label_map is None:
        if len(found) < 2:
            return None, None
        label_map = {folder: label for label, folder in enumerate(found)}
    missing = [folder for folder in found if folder not in label_map]
    if missing:
        what = "images outside class folders" if missing[0] == "" else f"the folder {shown(missing[0])}"
        raise DatasetError(f"the label map gives no class to {what} ({len(missing)} folder(s) unmapped)")
    return {name: label_map[folder] for name, folder in folders.items()}, {f: label_map[f] for f in found}


def read_label_map(path: str | os.PathLike) -> dict[str, int]:
    """{class name: class} from a JSON file: a plain map, a dataset.json with CLASSES_KEY, or a run's
    training_options.json (its dataset's); or from a dataset (folder or ZIP) whose dataset.json has one, or shards
    whose index keeps one."""
    if is_shard_dataset(path):
        stored = {CLASSES_KEY: read_index(path).get(CLASSES_KEY)}  # the class names kept from its dataset.json
    elif os.path.isdir(path) or str(path).lower().endswith(".zip"):
        files = FileTree(path)
        if LABELS_FILE not in files.names:
            raise DatasetError(f"{shown(path)} has no {LABELS_FILE}")
        stored = bounded_json.parse(files.read(LABELS_FILE, limit=bounded_json.MAX_BYTES), f"{path}: {LABELS_FILE}")
    else:
        stored = bounded_json.read(path)
    if isinstance(stored, dict) and isinstance(stored.get("dataset"), dict):
        stored = stored["dataset"]  # a run's training_options.json
    if isinstance(stored, dict) and CLASSES_KEY not in stored and "labels" not in stored:
        stored = {CLASSES_KEY: stored}  # a plain map
    classes = parse_classes(stored, path)
    if not classes:
        raise DatasetError(f"{shown(path)} holds no class names ({CLASSES_KEY}: {{name: class, ...}})")
    return classes


def choose_mode(source: ImageSource, channels: str, max_images: int | None = None) -> str:
    """The PIL mode of the converted images for convert --channels (CHANNEL_MODES): with 'auto', L when every
    image (of the first max_images) is grayscale (PIL modes 1, L, LA, I, F), else RGB.

    'auto' reads headers only, and stops at the first colour image; unreadable files are left to the conversion.
    """
    if CHANNEL_MODES[channels] is not None:
        return CHANNEL_MODES[channels]
    for name in source.names[:max_images]:
        try:
            with source.files.open(name) as stream, open_image(stream) as image:
                mode = image.mode
        except IMAGE_ERRORS:
            continue
        if PIL.Image.getmodebase(mode) != "L":
            return "RGB"
    return "L"


def is_transparent(image: PIL.Image.Image) -> bool:
    """True when some pixel of the image is not opaque: an alpha channel below 255 somewhere, or a palette or
    colour key (PNG's tRNS) that makes some pixel transparent."""
    if "A" not in image.getbands() and "transparency" not in image.info:
        return False
    return image.convert("RGBA").getchannel("A").getextrema()[0] < 255


def read_image(data: bytes, mode: str = "RGB", alpha: str = "drop",
               background: tuple[int, int, int] = BACKGROUNDS["white"]) -> tuple[np.ndarray, bool]:
    """Decode an image file to uint8 HWC RGB, or HW grayscale for mode L (palette images are converted), and say
    whether it had transparent pixels (is_transparent); alpha (ALPHA_MODES) says what becomes of them: dropped,
    kept as one more channel (HWC RGBA or LA), or composited onto the background colour.

    16-bit grayscale (PIL's I;16 modes: 16-bit PNG and TIFF, common for scientific images) is scaled to 8 bits as
    round(v * 255 / 65535); PIL's own conversion would clip every value above 255 to white. An image declaring
    more than MAX_IMAGE_PIXELS pixels is refused before decoding (open_image).
    """
    with open_image(io.BytesIO(data)) as image:
        if image.mode.startswith("I;16"):
            wide = np.asarray(image).astype(np.uint32)
            image = PIL.Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8), "L")
        transparent = is_transparent(image)
        if image.mode == "P" and "transparency" in image.info:
            # The palette's transparency as alpha first: PIL warns, once per image, converting it to RGB or L directly.
            image = image.convert("RGBA")
        if alpha == "keep":
            return np.asarray(image.convert(with_alpha(mode))), transparent
        if alpha == "composite" and transparent:
            canvas = PIL.Image.new("RGBA", image.size, (*background, 255))
            image = PIL.Image.alpha_composite(canvas, image.convert("RGBA"))
        return np.asarray(image.convert(mode)), transparent


class ConvertedImages(torch.utils.data.Dataset):
    """Source images read, transformed and PNG-encoded (in DataLoader workers).

    Items are (png bytes, (height, width), had transparent pixels), or (None, reason, False) for a file that cannot
    be read. alpha and background are read_image's.
    """

    def __init__(self, files: FileTree, names: list[str], transform: Callable[[np.ndarray], np.ndarray],
                 mode: str = "RGB", alpha: str = "drop", background: tuple[int, int, int] = BACKGROUNDS["white"]):
        self.files, self.names, self.transform, self.mode = files, names, transform, mode
        self.alpha, self.background = alpha, background

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, idx: int) -> tuple[bytes | None, tuple[int, int] | str, bool]:
        try:
            image, transparent = read_image(self.files.read(self.names[idx]), self.mode, self.alpha, self.background)
            image = self.transform(image)
        except (*IMAGE_ERRORS, DatasetError) as e:  # DatasetError: a file beyond FileTree.read's bounds
            return None, f"{type(e).__name__}: {one_line(e)}", False
        return png_bytes(image), image.shape[:2], transparent


def convert_images(source: ImageSource, writer: DatasetWriter, transform: Callable[[np.ndarray], np.ndarray],
                   max_images: int | None = None, workers: int = 0,
                   on_skip: Callable[[str, str], None] | None = None, mode: str = "RGB", alpha: str = "drop",
                   background: tuple[int, int, int] = BACKGROUNDS["white"]) -> tuple[int, int]:
    """Write the first max_images source images, transformed, as image i -> image_fname(i); return the count, and
    how many of them had transparent pixels (what alpha, read_image's, did to them the caller reports).

    Images are decoded in PIL mode `mode`: RGB, or L for one-channel PNGs (choose_mode).
    An unreadable image raises UnreadableImageError, or with on_skip is reported to on_skip(name, reason)
    and leaves its index unused. The written images must be square and of one size (ImageSizeError).
    """
    names = source.names[:max_images]
    writer.classes = source.classes
    images = torch.utils.data.DataLoader(ConvertedImages(source.files, names, transform, mode, alpha, background),
                                         batch_size=None, num_workers=workers)
    size, written, transparent = None, 0, 0
    for idx, (png, shape, had_alpha) in enumerate(tqdm(images, total=len(names), desc="convert", unit="img")):
        name = names[idx]
        if png is None:
            if on_skip is None:
                raise UnreadableImageError(f"cannot read image {shown(name)} in {shown(source.path)} ({shown(shape)})")
            on_skip(name, shape)
            continue
        if size is None:
            size = shape
            if size[0] != size[1]:
                raise ImageSizeError(f"{shown(name)} is {size[1]}x{size[0]}, not square; datasets hold square images")
        elif shape != size:
            raise ImageSizeError(f"{shown(name)} is {shape[1]}x{shape[0]} but earlier images are {size[1]}x{size[0]}")
        writer.add(image_fname(idx), png, None if source.labels is None else source.labels[name],
                   None if source.captions is None else source.captions[name])
        written += 1
        transparent += bool(had_alpha)
    if size is None:
        raise DatasetError(f"no image of {source.path} could be read")
    return written, transparent


class ConvertedSamples:
    """A source's first max_images images read as convert_images reads them (mode, transform, alpha handling; in
    `workers` DataLoader processes), as NCHW uint8 samples for a shard dataset: no gaps, so an unreadable image
    raises UnreadableImageError, and every image must be square and of the first one's size (ImageSizeError)."""

    def __init__(self, source: ImageSource, transform: Callable[[np.ndarray], np.ndarray],
                 max_images: int | None = None, mode: str = "RGB", alpha: str = "drop",
                 background: tuple[int, int, int] = BACKGROUNDS["white"], workers: int = 0):
        self.path, self.names, self.workers = source.path, source.names[:max_images], workers
        self.classes = source.classes
        self.labels = None if source.labels is None else np.array([source.labels[n] for n in self.names], np.int64)
        self.captions = None if source.captions is None else [source.captions[n] for n in self.names]
        self.transparent: set[int] = set()  # indices of the images read so far that had transparent pixels
        self._images = ConvertedImages(source.files, self.names, transform, mode, alpha, background)
        self._shape: tuple[int, ...] | None = None  # the first image's CHW, once read
        self._shape = self._sample(0, self._images[0]).shape
        if self._shape[1] != self._shape[2]:
            raise ImageSizeError(f"{shown(self.names[0])} is {self._shape[2]}x{self._shape[1]}, not square; datasets "
                                 f"hold square images")

    def __len__(self) -> int:
        return len(self.names)

    def _sample(self, idx: int, item: tuple[bytes | None, tuple[int, int] | str, bool]) -> np.ndarray:
        """Image idx from its ConvertedImages item, as CHW: the array a dataset of its PNG reads back."""
        png, shape, transparent = item
        if png is None:
            raise UnreadableImageError(f"cannot read image {shown(self.names[idx])} in {shown(self.path)} "
                                       f"({shown(shape)})")
        if transparent:
            self.transparent.add(idx)
        with PIL.Image.open(io.BytesIO(png)) as image:  # the PNG convert_images writes, decoded: the same pixels
            pixels = np.asarray(image)
        if self._shape is not None and pixels.shape[:2] != self._shape[1:]:
            raise ImageSizeError(f"{shown(self.names[idx])} is {pixels.shape[1]}x{pixels.shape[0]} but earlier "
                                 f"images are {self._shape[2]}x{self._shape[1]}")
        return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)

    def pixels(self, first: int, n: int) -> np.ndarray:
        """Samples [first, first + n), NCHW uint8."""
        items = torch.utils.data.DataLoader(torch.utils.data.Subset(self._images, range(first, first + n)),
                                            batch_size=None, num_workers=min(self.workers, n))
        return np.stack([self._sample(idx, item) for idx, item in enumerate(items, start=first)])
