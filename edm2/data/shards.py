"""Sharded array datasets: fixed-shape samples in shard files that every process memory-maps, and a small index.

A dataset is a folder (by convention NAME.shards) holding index.json and shard-KKKKKK.bin. The index records
what the samples are (an edm2.encoders.ENCODINGS name, "pixels" for uint8 images, "stability-vae" for the VAE's
mean/std latents, ..., and its settings), their dtype (the one its Encoder class stores) and CHW shape, the label
classes (0 for none) and, where the source's dataset.json names them, the class names ({name: class}, as
dataset.json's CLASSES_KEY), the count and the samples per shard; it does not grow with the dataset. Shard k holds
samples [k * shard_size, ...): a 64-byte header (SHARD_HEADER: magic, the dataset's id, k, its first sample, its
count, bytes per sample), the samples back to back, then one int32 label per sample when labeled; with "captions":
true in the index, captions-KKKKKK.json beside it lists its samples' captions in order. A process maps
at most MAX_OPEN_SHARDS shards at a time, so its own memory does not depend on the number of samples, and the page
cache is shared by every process of a machine.
"""

from __future__ import annotations

import collections
import collections.abc
import math
import os
import struct
from pathlib import Path

import numpy as np

from edm2.data.captions import CAPTIONS_KEY, CaptionError, check_caption
from edm2.data.dataset import ImageData, LabelsOf
from edm2.data.dataset_json import CLASSES_KEY, MAX_CLASSES, parse_classes
from edm2.data.dataset_files import MAX_FILE_BYTES, DatasetError
from edm2.encoders import ENCODINGS
from edm2.runtime import bounded_json, files

INDEX_FILE = "index.json"
FORMAT = "edm2-shards"
VERSION = 1
SHARD_HEADER = struct.Struct("<8s16sQQQQ8x")  # magic, dataset id, shard number, first sample, count, item bytes
MAGIC = b"EDM2SHRD"
MAX_SAMPLES = 1 << 40
MAX_SHARDS = 1 << 24
MAX_OPEN_SHARDS = 32  # maps held per process: bounded whatever the number of shards
LABEL_DTYPE = np.dtype("<i4")


def shard_name(k: int) -> str:
    """File name of shard k."""
    return f"shard-{k:06d}.bin"


def captions_name(k: int) -> str:
    """File name of shard k's captions: a JSON list of its samples' captions in order."""
    return f"captions-{k:06d}.json"


def has_captions(index: dict) -> bool:
    """True when the index says every shard has a captions file."""
    return index.get(CAPTIONS_KEY, False) is True


def read_captions(path: Path, index: dict, k: int) -> list[str]:
    """Shard k's captions, checked: one text (check_caption) per sample of the shard."""
    file = path / captions_name(k)
    try:
        captions = bounded_json.read(file)
    except OSError as e:
        raise CaptionError(f"{path}: {captions_name(k)} is missing or unreadable ({e.strerror or e})") from None
    except bounded_json.JSONFileError as e:
        raise CaptionError(str(e)) from None
    if not isinstance(captions, list) or len(captions) != shard_count(index, k):
        held = f"{len(captions)} entries" if isinstance(captions, list) else f"a JSON {type(captions).__name__}"
        raise CaptionError(f"{file}: holds {held}, not a list of the shard's {shard_count(index, k)} captions")
    return [check_caption(text, f"{file} entry {i}") for i, text in enumerate(captions)]


def is_shard_dataset(path: str | os.PathLike) -> bool:
    """True for a folder holding a shard index (of any file kind: read_index refuses one that is no regular file)."""
    return os.path.lexists(Path(path, INDEX_FILE))


def item_bytes(index: dict) -> int:
    """Bytes of one sample."""
    return math.prod(index["shape"]) * np.dtype(index["dtype"]).itemsize


def shard_count(index: dict, k: int) -> int:
    """Samples in shard k (all shards hold shard_size but the last)."""
    return min(index["shard_size"], index["count"] - k * index["shard_size"])


def num_shards(index: dict) -> int:
    """How many shard files the dataset has."""
    return -(-index["count"] // index["shard_size"])


def shard_bytes(index: dict, k: int) -> int:
    """The exact size of shard k's file."""
    n = shard_count(index, k)
    return SHARD_HEADER.size + n * item_bytes(index) + (n * LABEL_DTYPE.itemsize if index["label_dim"] else 0)


def shard_header(index: dict, k: int) -> bytes:
    """The 64 bytes that open shard k."""
    return SHARD_HEADER.pack(MAGIC, bytes.fromhex(index["id"]), k, k * index["shard_size"], shard_count(index, k),
                             item_bytes(index))


def _is_int(value: object, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def check_index(index: object, path: Path) -> dict:
    """The index's fields checked within bounds (before any shard is opened or anything allocated)."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise DatasetError(f"{path / INDEX_FILE}: {what}")
    need(isinstance(index, dict) and index.get("format") == FORMAT, f"not a shard index (format is not {FORMAT!r})")
    need(index.get("version") == VERSION, f"version {index.get('version')!r}; this project reads {VERSION}")
    encoding, dtype = index.get("encoding"), index.get("dtype")
    need(isinstance(encoding, str) and encoding in ENCODINGS, f"encoding {str(encoding)[:60]!r} is none of "
         f"{', '.join(ENCODINGS)} (edm2.encoders.ENCODINGS)")
    stored = ENCODINGS[encoding].stored_dtype
    need(dtype == stored, f"dtype {str(dtype)[:20]!r} is not {stored!r}, what {encoding} holds")
    need(isinstance(index.get("encoding_settings", {}), dict), "encoding_settings is not an object")
    shape = index.get("shape")
    need(isinstance(shape, list) and len(shape) == 3 and all(_is_int(n, 1, 1 << 16) for n in shape)
         and shape[1] == shape[2], f"shape {shape!r} is not a square CHW shape")
    need(item_bytes(index) <= MAX_FILE_BYTES, f"samples of {item_bytes(index)} bytes exceed {MAX_FILE_BYTES}")
    need(_is_int(index.get("label_dim"), 0, MAX_CLASSES), f"label_dim {index.get('label_dim')!r} is not in "
         f"[0, {MAX_CLASSES}]")
    need(_is_int(index.get("count"), 1, MAX_SAMPLES), f"count {index.get('count')!r} is not in [1, {MAX_SAMPLES}]")
    need(_is_int(index.get("shard_size"), 1, index["count"]), f"shard_size {index.get('shard_size')!r} is not "
         f"in [1, count]")
    need(num_shards(index) <= MAX_SHARDS, f"{num_shards(index)} shards, more than {MAX_SHARDS}")
    need(isinstance(index.get("id"), str) and len(index["id"]) == 32 and all(c in "0123456789abcdef"
                                                                             for c in index["id"]),
         "id is not 32 hexadecimal digits")
    need(isinstance(index.get(CAPTIONS_KEY, False), bool), f"{CAPTIONS_KEY} is not true or false")
    parse_classes(index, path / INDEX_FILE)
    return index


def read_index(path: str | os.PathLike) -> dict:
    """The checked index of a shard dataset."""
    path = Path(path)
    try:
        index = bounded_json.read(path / INDEX_FILE, max_bytes=1 << 20)
    except (OSError, bounded_json.JSONFileError) as e:
        raise DatasetError(f"{path / INDEX_FILE}: unreadable ({e})") from None
    return check_index(index, path)


def check_shard(path: Path, index: dict, k: int) -> None:
    """Refuse shard k when missing, of another size than the index says, or not the index's shard k."""
    file = path / shard_name(k)
    try:
        with files.open_input(file) as f:  # a FIFO or device is refused before its size is compared, not waited on
            size = os.fstat(f.fileno()).st_size
            header = f.read(SHARD_HEADER.size)
    except OSError as e:
        raise DatasetError(f"{path}: shard {shard_name(k)} is missing or unreadable ({e.strerror or e})") from None
    if size != shard_bytes(index, k):
        raise DatasetError(f"{path}: {shard_name(k)} holds {size} bytes, the index says {shard_bytes(index, k)} "
                           f"(truncated, or the index disagrees with its shards)")
    magic, ident, number, first, count, nbytes = SHARD_HEADER.unpack(header)
    if magic != MAGIC or ident.hex() != index["id"]:
        raise DatasetError(f"{path}: {shard_name(k)} is not a shard of this dataset (its header names another)")
    if (number, first, count, nbytes) != (k, k * index["shard_size"], shard_count(index, k), item_bytes(index)):
        raise DatasetError(f"{path}: {shard_name(k)} holds shard {number} (samples from {first}), the index puts "
                           f"shard {k} there; shards reordered or the index disagrees with its shards")


class ShardNames(collections.abc.Sequence):
    """The name of each sample, shard-KKKKKK.bin#I, made when asked for (a sequence, nothing held)."""

    def __init__(self, size: int, shard_size: int):
        self._size, self._shard_size = size, shard_size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, idx: int) -> str:
        if not 0 <= idx < self._size:
            raise IndexError(idx)
        return f"{shard_name(idx // self._shard_size)}#{idx % self._shard_size}"


class ShardDataset(ImageData):
    """Samples (uint8 or float32 CHW) and one-hot labels of a shard dataset; the interface of ImageFolderDataset.

    Every shard is checked when opened (present, of its size, its header the index's); the shards are mapped
    lazily in each process, at most MAX_OPEN_SHARDS at a time. max_size keeps the first max_size samples.
    """

    record_file = INDEX_FILE

    def __init__(self, path: str | os.PathLike, resolution: int | None = None, use_labels: bool = True,
                 max_size: int | None = None):
        self.path = Path(path)
        self.index = read_index(self.path)
        for k in range(num_shards(self.index)):
            check_shard(self.path, self.index, k)
            if has_captions(self.index) and not (self.path / captions_name(k)).is_file():
                raise CaptionError(f"{self.path}: {captions_name(k)} is missing; the index says its shards have "
                                   f"captions")
        beyond = self.path / shard_name(num_shards(self.index))
        if beyond.exists():
            raise DatasetError(f"{self.path}: holds {beyond.name}, beyond the index's {num_shards(self.index)} "
                               f"shards; the index disagrees with its shards")
        self.image_shape = list(self.index["shape"])
        self.encoding, self.encoding_settings = self.index["encoding"], self.index.get("encoding_settings", {})
        self._labeled = self.index["label_dim"] > 0
        self.label_dim = self.index["label_dim"] if use_labels else 0
        self._size = min(self.index["count"], max_size or self.index["count"])
        self.raw_labels = LabelsOf(self._size, self.label_of) if use_labels and self._labeled else None
        self.classes = self.index.get(CLASSES_KEY) if self.raw_labels is not None else None
        self._maps: collections.OrderedDict[int, np.memmap] = collections.OrderedDict()
        self._captions: collections.OrderedDict[int, list[str]] = collections.OrderedDict()
        if resolution is not None and self.resolution != resolution:
            raise DatasetError(f"{self.path}: samples are {self.resolution}x{self.resolution}, "
                               f"expected resolution {resolution}")

    def _shard(self, k: int) -> np.memmap:
        """Shard k's bytes, mapped in this process (the least recently used map is dropped beyond the bound)."""
        if k in self._maps:
            self._maps.move_to_end(k)
            return self._maps[k]
        if len(self._maps) >= MAX_OPEN_SHARDS:
            self._maps.popitem(last=False)
        try:
            with files.open_input(self.path / shard_name(k)) as f:  # the map keeps its own handle on the file
                self._maps[k] = np.memmap(f, dtype=np.uint8, mode="r")
        except OSError as e:
            raise DatasetError(f"{self.path}: cannot map {shard_name(k)} ({e.strerror or e})") from None
        return self._maps[k]

    def _locate(self, idx: int) -> tuple[np.memmap, int, int]:
        if not 0 <= idx < self._size:
            raise IndexError(f"sample {idx} of {self._size}")
        k, i = divmod(idx, self.index["shard_size"])
        return self._shard(k), i, shard_count(self.index, k)

    def load(self, idx: int) -> np.ndarray:
        """Sample idx as a writable CHW array; latents must be finite."""
        data, i, _ = self._locate(idx)
        size = item_bytes(self.index)
        start = SHARD_HEADER.size + i * size
        sample = np.frombuffer(data[start:start + size], dtype=self.index["dtype"]).reshape(self.image_shape).copy()
        if sample.dtype.kind == "f" and not np.isfinite(sample).all():
            raise DatasetError(f"{self.path}: sample {idx} holds non-finite values (NaN or infinity)")
        return sample

    def label_of(self, idx: int) -> int:
        """The class of sample idx (the dataset must be labeled)."""
        data, i, count = self._locate(idx)
        start = SHARD_HEADER.size + count * item_bytes(self.index) + i * LABEL_DTYPE.itemsize
        label = int(np.frombuffer(data[start:start + LABEL_DTYPE.itemsize], dtype=LABEL_DTYPE)[0])
        if not 0 <= label < self.index["label_dim"]:
            raise DatasetError(f"{self.path}: sample {idx} has label {label}, not a class below "
                               f"{self.index['label_dim']}")
        return label

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, idx: int) -> tuple[np.ndarray, np.ndarray]:
        return self.load(idx), self.get_label(idx)

    @property
    def has_captions(self) -> bool:
        """True when the index says the shards have captions (captions-KKKKKK.json)."""
        return has_captions(self.index)

    def get_caption(self, idx: int) -> str:
        """The caption of sample idx, from its shard's captions file (read and checked once, at most
        MAX_OPEN_SHARDS of them held)."""
        if not self.has_captions:
            return super().get_caption(idx)
        if not 0 <= idx < self._size:
            raise IndexError(f"sample {idx} of {self._size}")
        k, i = divmod(idx, self.index["shard_size"])
        if k not in self._captions:
            if len(self._captions) >= MAX_OPEN_SHARDS:
                self._captions.popitem(last=False)
            self._captions[k] = read_captions(self.path, self.index, k)
        self._captions.move_to_end(k)
        return self._captions[k][i]

    def get_label(self, idx: int) -> np.ndarray:
        """One-hot float32 label of sample idx; a zero-length array when the dataset has no labels."""
        onehot = np.zeros(self.label_dim, dtype=np.float32)
        if self.raw_labels is not None:
            onehot[self.label_of(idx)] = 1
        return onehot

    def close(self) -> None:
        """Drop this process's maps."""
        self._maps.clear()

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _maps=collections.OrderedDict(), _captions=collections.OrderedDict())

    @property
    def fnames(self) -> ShardNames:
        """Names of the samples in item order (shard file#position), as a folder dataset's file names."""
        return ShardNames(self._size, self.index["shard_size"])

    @property
    def name(self) -> str:
        """The folder's name without .shards."""
        return self.path.name.removesuffix(".shards")
