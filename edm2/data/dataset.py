"""Reading release-format datasets: a directory or ZIP of PNG or NPY images plus dataset.json (and, for metrics,
folders and ZIPs of images in any format PIL reads).

Writing them is edm2/data/dataset_writer.py's job; dataset_tool.py makes them from other images.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import zipfile
from pathlib import Path

import numpy as np
import PIL.Image
import torch

from edm2.data.dataset_files import IMAGE_ERRORS, DatasetError, FileTree, npy_header, open_image
from edm2.errors import shown
from edm2.runtime import bounded_json

IMAGE_SUFFIXES = (".png", ".npy")
# The one rule, for training and metrics alike: images in a PIL mode that is no channel layout of its own are
# decoded as the gray or colour image they show (a palette PNG's indices are no gray levels). Other modes stay
# as they are (RGBA trains as 4 channels; 16-bit images are refused as not 8-bit).
DECODED_MODES = {"1": "L", "P": "RGB", "PA": "RGBA", "CMYK": "RGB", "YCbCr": "RGB", "LAB": "RGB", "HSV": "RGB"}
# Reading any image format (for metrics), gray is decoded as RGB too: a folder may mix them (ImageNet's JPEGs
# include grayscale ones), and gray repeated to RGB is what metrics do with gray anyway.
MAX_CLASSES = 1 << 20  # 48x ImageNet-21k's classes; a one-hot label of 2**20 already takes 4 MiB per image
LABELS_FILE = "dataset.json"
CLASSES_KEY = "classes"  # dataset.json's {class name: class}, beside the release's "labels", which it leaves as is
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


def read_labels(files: FileTree, names: list[str]) -> list[int] | None:
    """The classes dataset.json gives `names`, in that order; None without dataset.json or with null labels."""
    return read_dataset_json(files, names)[0]


def read_dataset_json(files: FileTree, names: list[str]) -> tuple[list[int] | None, dict[str, int] | None]:
    """The classes dataset.json gives `names`, in that order, and its class names ({name: class}, CLASSES_KEY);
    each None where dataset.json has none.

    The one reader of dataset.json ({"labels": [[name, class], ...]} or {"labels": null}, the release's
    format, which dataset_tool.py convert extends with CLASSES_KEY): every name must be listed, with a class
    (is_class).
    """
    if LABELS_FILE not in files.names:
        return None, None
    try:
        text = files.read(LABELS_FILE, limit=bounded_json.MAX_BYTES)
    except (OSError, zipfile.BadZipFile) as e:
        raise DatasetError(f"{files.path}: cannot read {LABELS_FILE} ({e})") from None
    try:
        stored = bounded_json.parse(text, f"{files.path}: {LABELS_FILE}")
    except bounded_json.JSONFileError:
        stored = text  # parse_labels names what is wrong with it
    labels = parse_labels(stored, files.path)
    classes = parse_classes(stored, files.path)
    if labels is None:
        return None, classes
    missing = [name for name in names if name not in labels]
    if missing:
        raise DatasetError(f"{files.path}: {LABELS_FILE} has no label for {shown(missing[0])} "
                           f"({len(missing)} images unlabeled)")
    values = [labels[name] for name in names]
    wrong = [v for v in values if not is_class(v)]
    if wrong:
        raise DatasetError(f"{files.path}: {LABELS_FILE} labels must be non-negative integers below "
                           f"{MAX_CLASSES} (classes), found {json.dumps(wrong[0])}")
    return values, classes


def parse_classes(stored: object, path: str | os.PathLike) -> dict[str, int] | None:
    """The {class name: class} map of a parsed dataset.json (or --labels file), None when it has none; each name
    names one class and each class has one name."""
    classes = stored.get(CLASSES_KEY) if isinstance(stored, dict) else None
    if classes is None:
        return None
    if not isinstance(classes, dict) or not all(is_class(label) for label in classes.values()):
        raise DatasetError(f"{path}: {CLASSES_KEY} must map class names to classes (integers in [0, {MAX_CLASSES}))")
    if len(set(classes.values())) < len(classes):
        label = next(v for v in classes.values() if list(classes.values()).count(v) > 1)
        raise DatasetError(f"{path}: {CLASSES_KEY} gives class {label} two names")
    return classes


def read_encoding(files: FileTree) -> tuple[object, object]:
    """(encoding, encoding_settings) that dataset.json records (edm2.encoders.ENCODINGS names them); (None, {}) for
    a dataset written by the release or an earlier version, which records none."""
    if LABELS_FILE not in files.names:
        return None, {}
    try:
        record = bounded_json.parse(files.read(LABELS_FILE, limit=bounded_json.MAX_BYTES), LABELS_FILE)
    except (OSError, zipfile.BadZipFile, bounded_json.JSONFileError) as e:
        raise DatasetError(f"{files.path}: cannot read {LABELS_FILE} ({e})") from None
    if not isinstance(record, dict):
        return None, {}
    return record.get("encoding"), record.get("encoding_settings", {})


def is_class(label: object) -> bool:
    """Whether a dataset.json label is a class: an integer in [0, MAX_CLASSES) (JSON's true and false are not)."""
    return isinstance(label, int) and not isinstance(label, bool) and 0 <= label < MAX_CLASSES


def parse_labels(text: bytes | dict, path: str | os.PathLike) -> dict[str, object] | None:
    """{name: label} of a dataset.json text (or its parsed object), None for null labels; the labels themselves
    are checked later."""
    source = f"{path}: {LABELS_FILE}"
    try:
        listed = (text if isinstance(text, dict) else bounded_json.parse(text, source))["labels"]
    except bounded_json.JSONFileError as e:  # malformed, too large, too deep, or a number out of bounds
        reason = str(e).removeprefix(f"{source}: ")
    except KeyError:
        reason = "no 'labels' key"
    except TypeError as e:  # JSON that is not an object
        reason = f"TypeError: {e}"
    else:
        reason = None
    if reason is not None:
        raise DatasetError(f"{path}: {LABELS_FILE} is not in the release format "
                           f'{{"labels": [[name, class], ...]}} ({reason})')
    if listed is None:
        return None
    if not isinstance(listed, list) or not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                                               for e in listed):
        raise DatasetError(f"{path}: {LABELS_FILE} is not in the release format "
                           f'{{"labels": [[name, class], ...]}} (labels is not a list of [name, class] pairs)')
    return {name: label for name, label in listed}


def is_raw_image_folder(files: FileTree) -> bool:
    """True for images that dataset_tool.py did not write: no dataset.json, and names not in the release layout."""
    if LABELS_FILE in files.names:
        return False
    images = set(PIL.Image.registered_extensions()) | set(IMAGE_SUFFIXES)
    return any(suffix(name) in images and RELEASE_NAME.fullmatch(name) is None for name in files.names)


class ImageData(torch.utils.data.Dataset):
    """What every dataset kind shares (folders and ZIPs, shards, blends): image_shape (CHW), label_dim and the
    encoding it records (an edm2.encoders.ENCODINGS name and its settings; None for data that records none)."""

    image_shape: list[int] | None
    label_dim: int
    encoding: str | None = None
    encoding_settings: dict
    classes: dict[str, int] | None = None  # class names ({name: class}) where the dataset records them

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


class ImageFolderDataset(ImageData):
    """Images (uint8 CHW from PNG, float32 CHW from NPY) and one-hot labels of a release-format dataset.

    The first image fixes the shape; every later image's header is checked against it when read, before it is
    decoded, because reading all headers up front would take minutes on ImageNet-sized datasets. Palette and
    other modes are decoded by one rule (DECODED_MODES); .npy latents must be finite. Images that
    dataset_tool.py did not write (is_raw_image_folder) are checked a little more up front: no other
    image formats beside them, and the first image of every sub-folder has the first image's size; every
    error about them ends with a pointer to `dataset_tool.py convert`.

    classes is dataset.json's {class name: class} (CLASSES_KEY), None when it records none or labels are not used.

    With any_format (for metrics, not training), every image format PIL reads counts as images (JPEG, WebP, ...,
    beside .npy), and grayscale images are decoded as RGB too.
    """

    def __init__(self, path: str | os.PathLike, resolution: int | None = None, use_labels: bool = True,
                 max_size: int | None = None, any_format: bool = False):
        self.path = Path(path)
        self._files = FileTree(path)
        self._any_format = any_format
        self.image_shape: list[int] | None = None  # CHW, set by the first image
        self._raw = is_raw_image_folder(self._files)
        try:
            self._open(resolution, use_labels, max_size)
        except DatasetError as e:
            raise DatasetError(f"{e}{convert_hint(self.path)}" if self._raw else str(e)) from None

    def _open(self, resolution: int | None, use_labels: bool, max_size: int | None) -> None:
        suffixes = [suffix(name) for name in self._files.names]
        readable = {*PIL.Image.registered_extensions(), ".npy"} if self._any_format else set(IMAGE_SUFFIXES)
        self._all_fnames = [name for name, kind in zip(self._files.names, suffixes) if kind in readable]
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
        self.encoding, self.encoding_settings = read_encoding(self._files)

        # Like the release: a max_size subset is a fixed random choice (seed 0), kept in file order.
        self._raw_idx = np.arange(len(self._all_fnames), dtype=np.int64)
        if max_size is not None and max_size < self._raw_idx.size:
            np.random.RandomState(0).shuffle(self._raw_idx)
            self._raw_idx = np.sort(self._raw_idx[:max_size])
        self.raw_labels = None if all_labels is None else np.array(all_labels, dtype=np.int64)[self._raw_idx]
        self.label_dim = 0 if all_labels is None else max(all_labels) + 1

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
        return self._load(self._raw_idx[idx]), self.get_label(idx)

    def get_label(self, idx: int) -> np.ndarray:
        """One-hot float32 label of item idx; a zero-length array when the dataset has no labels."""
        onehot = np.zeros(self.label_dim, dtype=np.float32)
        if self.raw_labels is not None:
            onehot[self.raw_labels[idx]] = 1
        return onehot

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
