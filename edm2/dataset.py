"""Release-format datasets: a directory or uncompressed ZIP of PNG or NPY images plus dataset.json."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import PIL.Image
import torch

from edm2 import files

IMAGE_SUFFIXES = (".png", ".npy")
LABELS_FILE = "dataset.json"
# A fixed timestamp keeps ZIP bytes identical between runs that write identical files.
_ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names its path and what is wrong."""


def image_fname(idx: int) -> str:
    """Release file name of the PNG image with index idx."""
    return f"{idx // 1000:05d}/img{idx:08d}.png"


def latent_fname(idx: int) -> str:
    """Release file name of the mean/std latents (.npy) of the image with index idx."""
    return f"{idx // 1000:05d}/img-mean-std-{idx:08d}.npy"


def png_bytes(image: np.ndarray, compress_level: int = 0) -> bytes:
    """Encode a uint8 HWC RGB array as PNG (uncompressed by default, like the release)."""
    buffer = io.BytesIO()
    PIL.Image.fromarray(image).save(buffer, format="png", compress_level=compress_level)
    return buffer.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    """Serialize an array in .npy format."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def labels_json(labels: dict[str, int | None]) -> str:
    """dataset.json text: every file's class, or null unless every file has one (as the release)."""
    complete = len(labels) > 0 and all(label is not None for label in labels.values())
    return json.dumps({"labels": [[name, int(label)] for name, label in labels.items()] if complete else None})


def is_zip_path(path: str | os.PathLike) -> bool:
    """True when a dataset path names a ZIP file rather than a directory."""
    return str(path).lower().endswith(".zip")


class DatasetWriter:
    """Collects files and labels of a dataset being written; see dataset_writer()."""

    def __init__(self, add_file: Callable[[str, bytes], None]):
        self._add_file = add_file
        self.labels: dict[str, int | None] = {}

    def add(self, fname: str, data: bytes, label: int | None = None) -> None:
        """Store one image file under its release name with its class (None for unlabeled)."""
        self._add_file(fname, data)
        self.labels[fname] = label


def write_zip_member(archive: zipfile.ZipFile, fname: str, data: bytes | str) -> None:
    """Add an uncompressed member with a fixed timestamp, so equal inputs give equal ZIP bytes."""
    info = zipfile.ZipInfo(fname, date_time=_ZIP_DATE_TIME)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    archive.writestr(info, data)


@contextlib.contextmanager
def dataset_writer(dest: str | os.PathLike) -> Iterator[DatasetWriter]:
    """Write a dataset to a temporary ZIP or directory, add dataset.json, and rename onto dest on success."""
    dest = Path(dest)
    if is_zip_path(dest):
        with files.atomic_path(dest) as tmp:
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as archive:
                writer = DatasetWriter(lambda fname, data: write_zip_member(archive, fname, data))
                yield writer
                write_zip_member(archive, LABELS_FILE, labels_json(writer.labels))
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    tmp.chmod(0o777 & ~files.current_umask())  # mkdtemp makes the folder private
    try:
        writer = DatasetWriter(lambda fname, data: _write_file(tmp / fname, data))
        yield writer
        (tmp / LABELS_FILE).write_text(labels_json(writer.labels))
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


class FileTree:
    """Read-only files of a directory or ZIP, usable from several processes (each opens the ZIP itself)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._zip: zipfile.ZipFile | None = None
        self._zip_pid: int | None = None
        if self.path.is_dir():
            self.is_zip = False
            names = [Path(root, name).relative_to(self.path).as_posix()
                     for root, _dirs, fnames in os.walk(self.path) for name in fnames]
        elif self.path.is_file():
            self.is_zip = True
            names = [name for name in self._archive().namelist() if not name.endswith("/")]
        else:
            raise DatasetError(f"{self.path}: no such directory or ZIP file")
        self.names: list[str] = sorted(names)

    def _archive(self) -> zipfile.ZipFile:
        # A ZipFile shares its file offset, so each process (DataLoader worker) opens its own.
        if self._zip is None or self._zip_pid != os.getpid():
            try:
                self._zip = zipfile.ZipFile(self.path)
            except (zipfile.BadZipFile, OSError) as e:
                raise DatasetError(f"{self.path}: not a readable ZIP file ({e})") from None
            self._zip_pid = os.getpid()
        return self._zip

    def read(self, name: str) -> bytes:
        """The bytes of one file, named by its relative path."""
        if self.is_zip:
            return self._archive().read(name)
        return (self.path / name).read_bytes()

    def close(self) -> None:
        """Close the ZIP file if this process opened it."""
        if self._zip is not None and self._zip_pid == os.getpid():
            self._zip.close()
        self._zip = None

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _zip=None, _zip_pid=None)


class ImageFolderDataset(torch.utils.data.Dataset):
    """Images (uint8 CHW from PNG, float32 CHW from NPY) and one-hot labels of a release-format dataset.

    The first image fixes the shape; every later image is checked against it when read, because
    reading all headers up front would take minutes on ImageNet-sized datasets.
    """

    def __init__(self, path: str | os.PathLike, resolution: int | None = None, use_labels: bool = True,
                 max_size: int | None = None):
        self.path = Path(path)
        self._files = FileTree(path)
        self._all_fnames = [name for name in self._files.names if Path(name).suffix.lower() in IMAGE_SUFFIXES]
        if not self._all_fnames:
            raise DatasetError(f"{self.path}: no .png or .npy images found")
        if len({Path(name).suffix.lower() for name in self._all_fnames}) > 1:
            raise DatasetError(f"{self.path}: mixes .png and .npy images; a dataset holds one kind")
        all_labels = self._read_labels() if use_labels else None

        # Like the release: a max_size subset is a fixed random choice (seed 0), kept in file order.
        self._raw_idx = np.arange(len(self._all_fnames), dtype=np.int64)
        if max_size is not None and max_size < self._raw_idx.size:
            np.random.RandomState(0).shuffle(self._raw_idx)
            self._raw_idx = np.sort(self._raw_idx[:max_size])
        self.raw_labels = None if all_labels is None else all_labels[self._raw_idx]
        self.label_dim = 0 if all_labels is None else int(all_labels.max()) + 1

        first = self._load(self._raw_idx[0])
        if first.ndim != 3 or first.shape[1] != first.shape[2]:
            raise DatasetError(f"{self.path}: {self._all_fnames[self._raw_idx[0]]} has shape "
                               f"{_shape_text(first.shape)}; images must be square CHW")
        self.image_shape = list(first.shape)
        if resolution is not None and self.resolution != resolution:
            raise DatasetError(f"{self.path}: images are {self.resolution}x{self.resolution}, "
                               f"expected resolution {resolution}")

    def _read_labels(self) -> np.ndarray | None:
        if LABELS_FILE not in self._files.names:
            return None
        try:
            labels = json.loads(self._files.read(LABELS_FILE))["labels"]
            if labels is None:
                return None
            labels = {str(name): label for name, label in labels}
        except (ValueError, KeyError, TypeError) as e:
            raise DatasetError(f"{self.path}: {LABELS_FILE} is not in the release format ({e})") from None
        missing = [name for name in self._all_fnames if name not in labels]
        if missing:
            raise DatasetError(f"{self.path}: {LABELS_FILE} has no label for {missing[0]} "
                               f"({len(missing)} images unlabeled)")
        values = [labels[name] for name in self._all_fnames]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise DatasetError(f"{self.path}: {LABELS_FILE} labels must be non-negative integers")
        return np.array(values, dtype=np.int64)

    def _load(self, raw_idx: int) -> np.ndarray:
        fname = self._all_fnames[raw_idx]
        try:
            data = io.BytesIO(self._files.read(fname))
            if fname.lower().endswith(".npy"):
                return np.load(data, allow_pickle=False).astype(np.float32, copy=False)
            image = np.asarray(PIL.Image.open(data))
        except (OSError, ValueError, SyntaxError, zipfile.BadZipFile, PIL.Image.DecompressionBombError) as e:
            raise DatasetError(f"{self.path}: cannot read {fname} ({e})") from None  # PIL: SyntaxError = bad chunk
        if image.dtype != np.uint8:
            raise DatasetError(f"{self.path}: {fname} is not an 8-bit image ({image.dtype})")
        return image.reshape(*image.shape[:2], -1).transpose(2, 0, 1).copy()  # writable, contiguous CHW

    def close(self) -> None:
        """Close the ZIP file if this process opened it."""
        self._files.close()

    def __len__(self) -> int:
        return int(self._raw_idx.size)

    def __getitem__(self, idx: int) -> tuple[np.ndarray, np.ndarray]:
        raw_idx = self._raw_idx[idx]
        image = self._load(raw_idx)
        if list(image.shape) != self.image_shape:
            raise DatasetError(f"{self.path}: {self._all_fnames[raw_idx]} has shape {_shape_text(image.shape)} "
                               f"but the first image has {_shape_text(self.image_shape)}; mixed resolutions")
        return image, self.get_label(idx)

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
        """True when labels were requested and dataset.json provides them."""
        return self.label_dim > 0


def _shape_text(shape) -> str:
    return "x".join(str(int(n)) for n in shape)
