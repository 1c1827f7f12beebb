"""Reading release-format datasets: a directory or ZIP of PNG or NPY images plus dataset.json (and, for metrics,
folders and ZIPs of images in any format PIL reads).

Writing them is edm2/data/dataset_writer.py's job; dataset_tool.py makes them from other images.
"""

from __future__ import annotations

import io
import math
import os
import re
from pathlib import Path
from typing import Callable

import numpy as np
import PIL.Image
import torch

from edm2.data.captions import CaptionError, read_dataset_captions
from edm2.data.dataset_files import IMAGE_ERRORS, DatasetError, FileTree, npy_header, open_image
from edm2.data.dataset_json import LABELS_FILE, read_dataset_json, read_record
from edm2.data.text_data import TextEmbeddings, is_text_file
from edm2.errors import shown

IMAGE_SUFFIXES = (".png", ".npy")
# The one rule, for training and metrics alike: images in a PIL mode that is no channel layout of its own are
# decoded as the gray or colour image they show (a palette PNG's indices are no gray levels). Other modes stay
# as they are (RGBA trains as 4 channels; 16-bit images are refused as not 8-bit).
DECODED_MODES = {"1": "L", "P": "RGB", "PA": "RGBA", "CMYK": "RGB", "YCbCr": "RGB", "LAB": "RGB", "HSV": "RGB"}
# Reading any image format (for metrics), gray is decoded as RGB too: a folder may mix them (ImageNet's JPEGs
# include grayscale ones), and gray repeated to RGB is what metrics do with gray anyway.
# The release's dataset_tool.py names image i NNNNN/imgIIIIIIII.png (NNNNN = the first 5 of 8 digits).
RELEASE_NAME = re.compile(r"\d{5}/img(-mean-std-)?\d{8}\.(png|npy)")


def image_fname(idx: int) -> str:
    """Release file name of the PNG image with index idx."""
    return f"{idx // 1000:05d}/img{idx:08d}.png"


def latent_fname(idx: int) -> str:
    """Release file name of the mean/std latents (.npy) of the image with index idx."""
    return f"{idx // 1000:05d}/img-mean-std-{idx:08d}.npy"


def suffix(name: str) -> str:
    """A file name's extension in lower case ('.png'); os.path is several times faster than pathlib on millions."""
    return os.path.splitext(name)[1].lower()


def source_image_names(names: list[str]) -> list[str]:
    """The names among `names` that PIL can read as images (what dataset_tool.py convert takes in)."""
    extensions = set(PIL.Image.registered_extensions())
    return [name for name in names if suffix(name) in extensions]


def convert_hint(path: str | os.PathLike) -> str:
    """The pointer for a folder of images that is not a dataset yet."""
    return (f"; a folder of images becomes a dataset with `python dataset_tool.py convert --source={path} "
            f"--dest=DATASET.zip` first")


def is_raw_image_folder(files: FileTree) -> bool:
    """True for images that dataset_tool.py did not write: no dataset.json, and names not in the release layout."""
    if LABELS_FILE in files.names:
        return False
    images = set(PIL.Image.registered_extensions()) | set(IMAGE_SUFFIXES)
    return any(suffix(name) in images and RELEASE_NAME.fullmatch(name) is None for name in files.names)


class LabelsOf:
    """The class of each of `size` items, label_of(index) when asked for (a sequence, nothing held)."""

    def __init__(self, size: int, label_of: Callable[[int], int]):
        self._size, self._label_of = size, label_of

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, idx: int) -> int:
        return self._label_of(int(idx))


class ImageData(torch.utils.data.Dataset):
    """What every dataset kind shares (folders and ZIPs, shards, blends): image_shape (CHW), label_dim and the
    encoding it records (an edm2.encoders.ENCODINGS name and its settings; None for data that records none) in
    its record_file."""

    image_shape: list[int] | None
    label_dim: int
    encoding: str | None = None
    encoding_settings: dict
    record_file = LABELS_FILE
    classes: dict[str, int] | None = None  # class names ({name: class}) where the dataset records them
    has_text: bool = False  # cached text embeddings (edm2.data.text_data), whose conditions are then the labels

    @property
    def num_channels(self) -> int:
        """Channels per image: 3 for RGB PNG, 8 for mean/std latents."""
        return self.image_shape[0]

    @property
    def resolution(self) -> int:
        """Height (= width) of every image."""
        return self.image_shape[1]

    @property
    def has_labels(self) -> bool:
        """True when labels were requested and the dataset provides them."""
        return self.label_dim > 0

    @property
    def has_captions(self) -> bool:
        """True when every item has a caption (possibly empty) in the dataset's record."""
        return False

    def get_caption(self, idx: int) -> str:
        """The caption of item idx; CaptionError for a dataset without captions."""
        raise CaptionError(f"{getattr(self, 'path', 'the dataset')}: has no captions")


class ImageFolderDataset(ImageData):
    """Images (uint8 CHW from PNG, float32 CHW from NPY) and one-hot labels of a release-format dataset.

    The first image fixes the shape; every later image's header is checked against it when read, before it is
    decoded, because reading all headers up front would take minutes on ImageNet-sized datasets. Palette and
    other modes are decoded by one rule (DECODED_MODES); .npy latents must be finite. Images that
    dataset_tool.py did not write (is_raw_image_folder) are checked a little more up front: no other
    image formats beside them, and the first image of every sub-folder has the first image's size; every
    error about them ends with a pointer to `dataset_tool.py convert`.

    classes is dataset.json's {class name: class} (CLASSES_KEY), None when it records none or labels are not used.

    Captions (get_caption) and cached text embeddings (edm2.data.text_data) are read where dataset.json records
    them; with embeddings and use_text, an item's label is its caption's condition [1 + L, D + 1]
    (edm2.text_condition), not a one-hot class.

    With any_format (for metrics, not training), every image format PIL reads counts as images (JPEG, WebP, ...,
    beside .npy), and grayscale images are decoded as RGB too.
    """

    def __init__(self, path: str | os.PathLike, resolution: int | None = None, use_labels: bool = True,
                 max_size: int | None = None, any_format: bool = False, use_text: bool = True):
        self.path = Path(path)
        self._use_text = use_text
        self._files = FileTree(path)
        self._any_format = any_format
        self.image_shape: list[int] | None = None  # CHW, set by the first image
        self._raw = is_raw_image_folder(self._files)
        try:
            self._open(resolution, use_labels, max_size)
        except DatasetError as e:
            raise DatasetError(f"{e}{convert_hint(self.path)}" if self._raw else str(e)) from None

    def _open(self, resolution: int | None, use_labels: bool, max_size: int | None) -> None:
        names = [name for name in self._files.names if not is_text_file(name)]  # embeddings are no images
        suffixes = [suffix(name) for name in names]
        readable = {*PIL.Image.registered_extensions(), ".npy"} if self._any_format else set(IMAGE_SUFFIXES)
        self._all_fnames = [name for name, kind in zip(names, suffixes) if kind in readable]
        kinds = set(suffixes)
        others = sorted(kinds & set(PIL.Image.registered_extensions()) - readable)
        if not self._all_fnames:
            found = f" (found {', '.join(others)} files)" if others else ""
            raise DatasetError(f"{self.path}: no {'' if self._any_format else '.png or .npy '}images found{found}")
        if self._raw and others:
            raise DatasetError(f"{self.path}: holds {', '.join(others)} images beside the .png/.npy ones; "
                               f"a dataset holds one kind")
        pictures = sorted(kinds & readable - {".npy"})
        if ".npy" in kinds and pictures:
            raise DatasetError(f"{self.path}: mixes {', '.join(pictures)} and .npy images; a dataset holds one kind")
        all_labels, self.classes = read_dataset_json(self._files, self._all_fnames) if use_labels else (None, None)
        record = read_record(self._files)
        self.encoding, self.encoding_settings = record.get("encoding"), record.get("encoding_settings", {})
        self._text = TextEmbeddings(self._files, record, self._all_fnames) if "text_encoding" in record else None

        # Like the release: a max_size subset is a fixed random choice (seed 0), kept in file order.
        self._raw_idx = np.arange(len(self._all_fnames), dtype=np.int64)
        if max_size is not None and max_size < self._raw_idx.size:
            np.random.RandomState(0).shuffle(self._raw_idx)
            self._raw_idx = np.sort(self._raw_idx[:max_size])
        self.raw_labels = None if all_labels is None else np.array(all_labels, dtype=np.int64)[self._raw_idx]
        self.label_dim = 0 if all_labels is None else max(all_labels) + 1
        captions = read_dataset_captions(self._files, self._all_fnames)
        self._captions = None if captions is None else [captions[i] for i in self._raw_idx]

        first = self._load(self._raw_idx[0])
        if first.ndim != 3 or first.shape[1] != first.shape[2]:
            raise DatasetError(f"{self.path}: {shown(self._all_fnames[self._raw_idx[0]])} has shape "
                               f"{_shape_text(first.shape)}; images must be square CHW")
        self.image_shape = list(first.shape)
        if self._raw:
            self._check_folder_sizes()
        if resolution is not None and self.resolution != resolution:
            raise DatasetError(f"{self.path}: images are {self.resolution}x{self.resolution}, "
                               f"expected resolution {resolution}")

    def _check_folder_sizes(self) -> None:
        # One header per sub-folder: the class folders of a raw image tree (ImageNet's) hold images of many
        # sizes. Top-level files are left to the check when read: generate.py puts its grid.png there.
        firsts = {os.path.dirname(name): idx for idx, name in reversed(list(enumerate(self._all_fnames)))}
        for idx in sorted(idx for folder, idx in firsts.items() if folder):
            name, size = self._all_fnames[idx], self._image_size(idx)
            if size != self.image_shape[1:]:
                raise DatasetError(f"{self.path}: {shown(name)} is {_shape_text(size[::-1])} but "
                                   f"{shown(self._all_fnames[self._raw_idx[0]])} is {_shape_text(self.image_shape[:0:-1])}; "
                                   f"mixed sizes")

    def _image_size(self, raw_idx: int) -> list[int]:
        fname = self._all_fnames[raw_idx]
        try:
            if fname.lower().endswith(".npy"):
                return list(npy_header(self._files.read(fname))[0][1:])
            with self._files.open(fname) as stream, open_image(stream) as image:
                return [image.height, image.width]
        except IMAGE_ERRORS as e:
            raise DatasetError(f"{self.path}: cannot read {shown(fname)} ({e})") from None

    def _load(self, raw_idx: int) -> np.ndarray:
        """Image raw_idx as CHW; its header is checked against the first image's shape before it is decoded."""
        fname = self._all_fnames[raw_idx]
        try:
            data = self._files.read(fname)
            if fname.lower().endswith(".npy"):
                return self._load_npy(raw_idx, data)
            with open_image(io.BytesIO(data)) as pil:
                mode = DECODED_MODES.get(pil.mode, pil.mode)
                mode = "RGB" if self._any_format and mode == "L" else mode
                self._check_shape(raw_idx, [PIL.Image.getmodebands(mode), pil.height, pil.width])
                image = np.asarray(pil if mode == pil.mode else pil.convert(mode))
        except IMAGE_ERRORS as e:
            raise DatasetError(f"{self.path}: cannot read {shown(fname)} ({e})") from None
        if image.dtype != np.uint8:
            raise DatasetError(f"{self.path}: {shown(fname)} is not an 8-bit image ({image.dtype})")
        return image.reshape(*image.shape[:2], -1).transpose(2, 0, 1).copy()  # writable, contiguous CHW

    def _load_npy(self, raw_idx: int, data: bytes) -> np.ndarray:
        """Float32 latents of a .npy file whose header agrees with its size and the first image's shape."""
        fname = self._all_fnames[raw_idx]
        shape, fortran, dtype, offset = npy_header(data)
        if dtype.kind not in "fiu":
            raise DatasetError(f"{self.path}: {shown(fname)} holds {dtype} values; latents are real numbers")
        count = math.prod(shape)  # Python integers: a hostile shape cannot overflow
        if count * dtype.itemsize != len(data) - offset:
            raise DatasetError(f"{self.path}: {shown(fname)} declares shape {_shape_text(shape)} of {dtype} "
                               f"({count * dtype.itemsize} bytes) but holds {len(data) - offset} bytes of values")
        self._check_shape(raw_idx, list(shape))
        values = np.frombuffer(data, dtype, count=count, offset=offset).reshape(shape, order="F" if fortran else "C")
        latents = np.array(values, dtype=np.float32, order="C")
        if not np.isfinite(latents).all():
            raise DatasetError(f"{self.path}: {shown(fname)} holds non-finite values (NaN or infinity)")
        return latents

    def _check_shape(self, raw_idx: int, shape: list[int]) -> None:
        """Refuse an image whose (declared) shape differs from the first image's; the first sets it."""
        if self.image_shape is None or shape == self.image_shape:
            return
        hint = convert_hint(self.path) if self._raw else ""
        mixed = "resolutions" if shape[1:] != self.image_shape[1:] else "channel counts (gray and colour)"
        raise DatasetError(f"{self.path}: {shown(self._all_fnames[raw_idx])} has shape {_shape_text(shape)} "
                           f"but the first image has {_shape_text(self.image_shape)}; mixed {mixed}{hint}")

    def close(self) -> None:
        """Close the ZIP file if this process opened it."""
        self._files.close()

    def __len__(self) -> int:
        return int(self._raw_idx.size)

    def __getitem__(self, idx: int) -> tuple[np.ndarray, np.ndarray]:
        label = self.get_condition(idx) if self.has_text else self.get_label(idx)
        return self._load(self._raw_idx[idx]), label

    @property
    def has_text(self) -> bool:
        """Whether the dataset holds cached text embeddings (dataset_tool.py encode-text) and uses them (use_text):
        opened with use_text=False it is seen as a dataset without text (an unconditional run on captioned data)."""
        return self._text is not None and self._use_text

    @property
    def text_record(self) -> dict:
        """dataset.json's "text_encoding" record: the encoder's identity, tokens L, dim D and the pooling."""
        return self._cached_text().record

    def get_condition(self, idx: int) -> np.ndarray:
        """float32 [1 + L, D + 1] text condition of item idx (edm2.text_condition)."""
        return self._cached_text().condition(int(self._raw_idx[idx]))

    def empty_condition(self) -> np.ndarray:
        """float32 [1 + L, D + 1] condition of the empty caption (text dropout, unconditional guidance)."""
        return self._cached_text().empty_condition()

    def _cached_text(self) -> TextEmbeddings:
        if self._text is None:
            raise DatasetError(f"{self.path}: holds no text embeddings; dataset_tool.py encode-text makes them")
        return self._text

    def get_label(self, idx: int) -> np.ndarray:
        """One-hot float32 label of item idx; a zero-length array when the dataset has no labels."""
        onehot = np.zeros(self.label_dim, dtype=np.float32)
        if self.raw_labels is not None:
            onehot[self.raw_labels[idx]] = 1
        return onehot

    @property
    def has_captions(self) -> bool:
        """True when dataset.json gives every image a caption."""
        return self._captions is not None

    def get_caption(self, idx: int) -> str:
        """The caption dataset.json gives item idx."""
        if self._captions is None:
            return super().get_caption(idx)
        return self._captions[idx]

    @property
    def fnames(self) -> list[str]:
        """Relative paths of the images, in item order."""
        return [self._all_fnames[i] for i in self._raw_idx]

    @property
    def name(self) -> str:
        """The dataset's file or directory name without .zip."""
        return self.path.stem if self._files.is_zip else self.path.name


def _shape_text(shape) -> str:
    return "x".join(str(int(n)) for n in shape)
