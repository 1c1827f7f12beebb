"""Webdataset tar shards as a source of images (img2dataset's layout: KEY.jpg/png/webp plus KEY.cls or KEY.json
per sample), grouped into samples by webdataset's key rule (the `webdataset` package: the extra edm2[webdataset]).

The source is a .tar file (plain, or compressed by gzip, bzip2 or xz), a folder of .tar files (sorted by name), or a
brace pattern (data/{00000..00099}.tar). A first pass reads every tar to its end and checks it whole (each member a
regular file of bounded size, each key once, each class and JSON sidecar readable, the end-of-archive block there),
so a malformed archive is one line naming the archive and the member before any work. Samples are then read in
order: a read that starts where the last one stopped continues in the open tar, so reading every sample once reads
each tar once.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import tarfile
import zlib
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np

from edm2.data.captions import CaptionError, caption_text, check_caption
from edm2.data.convert import BACKGROUNDS, read_image
from edm2.data.dataset_json import is_class
from edm2.data.dataset_files import IMAGE_ERRORS, MAX_FILE_BYTES, DatasetError, open_image
from edm2.errors import shown
from edm2.runtime import bounded_json, files

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
LABEL_KEYS = ("cls", "json")
CAPTION_KEYS = ("txt", "json")  # KEY.txt, else KEY.json's "text", else its "caption" (img2dataset writes both)
TAR_INSTALL = "pip install webdataset (or the extra: pip install 'edm2[webdataset]')"
MAX_MEMBER_BYTES = MAX_FILE_BYTES  # a sample's file is bounded as a file of a folder or ZIP dataset is
# The first bytes of a compressed tar, and the reader that decompresses it (the tar's bytes, or EOFError at a cut).
_COMPRESSED = {b"\x1f\x8b": lambda raw: gzip.GzipFile(fileobj=raw), b"BZh": bz2.BZ2File,
               b"\xfd7zXZ\x00": lzma.LZMAFile}
_READ_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError)
_HEADER = tarfile.BLOCKSIZE
_KIND = {tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link", tarfile.CHRTYPE: "a character device",
         tarfile.BLKTYPE: "a block device", tarfile.FIFOTYPE: "a FIFO"}


class TarSourceError(DatasetError):
    """Tar shards that cannot be used: the package missing, a malformed archive or member, a sample without its image
    or class, mixed sizes."""


def _base_plus_ext() -> Callable[[str], tuple[str | None, str | None]]:
    try:
        from webdataset import tariterators
    except ImportError:
        raise TarSourceError(f"reading webdataset tar shards needs the webdataset package: {TAR_INSTALL}") from None
    return tariterators.base_plus_ext


def is_tar_source(spec: str | os.PathLike) -> bool:
    """True for a .tar file, a brace pattern of them, or a folder holding .tar files and no dataset."""
    spec = str(spec)
    if spec.endswith(".tar"):
        return True
    folder = Path(spec)
    return folder.is_dir() and any(folder.glob("*.tar")) and not any(
        (folder / name).exists() for name in ("dataset.json", "index.json"))


def tar_paths(spec: str | os.PathLike) -> list[str]:
    """The tar files of a source, in order; each must be a regular file (a FIFO would never end)."""
    spec = str(spec)
    if Path(spec).is_dir():
        paths = sorted(str(p) for p in Path(spec).glob("*.tar"))
    else:
        from braceexpand import braceexpand  # webdataset's dependency
        paths = list(braceexpand(spec)) if "{" in spec else [spec]
    if not paths:
        raise TarSourceError(f"{spec}: no tar file found")
    for path in paths:
        try:
            files.open_input(path).close()  # refuses a FIFO or device without waiting on it
        except FileNotFoundError:
            raise TarSourceError(f"{spec}: no tar file {path}") from None
        except IsADirectoryError:
            raise TarSourceError(f"{shown(path)}: a folder, not a regular file; a tar source is regular .tar "
                                 f"files") from None
        except OSError as e:
            raise TarSourceError(f"{shown(path)}: {e.strerror or e}; a tar source is regular .tar files") from None
    return paths
    return paths


class _Tail:
    """A byte stream that keeps its last bytes read, so the block where tarfile stopped can be looked at after it."""

    KEEP = 4 * tarfile.RECORDSIZE  # tarfile reads ahead one record at a time

    def __init__(self, stream: BinaryIO):
        self.stream, self.end, self.tail = stream, 0, b""

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.end += len(data)
        self.tail = (self.tail + data)[-self.KEEP:]
        return data

    def block(self, offset: int) -> bytes | None:
        """The (at most) one header block of bytes from offset, None when no longer held."""
        start = self.end - len(self.tail)
        return self.tail[offset - start:offset - start + _HEADER] if offset >= start else None


def _opened(raw: BinaryIO) -> BinaryIO:
    """The tar bytes of a file: the file itself, or its decompression (by its first bytes)."""
    magic = raw.read(6)
    raw.seek(0)
    opener = next((opener for prefix, opener in _COMPRESSED.items() if magic.startswith(prefix)), None)
    return raw if opener is None else opener(raw)


def _members(path: str, wanted: Callable[[str], bool]) -> Iterator[tuple[str, bytes | None]]:
    """(name, data) of the files of one tar in order (data only where wanted(name), else None); TarSourceError naming
    the archive and the member for a member that is no regular file or too large, and for a damaged or cut archive."""
    where, last = "at its first member", None
    try:
        with files.open_input(path) as raw:
            stream = _Tail(_opened(raw))
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for member in tar:
                    tar.members = []  # one pass: keep no member list
                    name = shown(member.name)
                    where = f"in member {name}"
                    if member.isdir():
                        continue
                    if not member.isreg():
                        kind = _KIND.get(member.type, f"of tar type {member.type!r}")
                        raise TarSourceError(f"{path}: member {name} is {kind}, not a regular file")
                    if member.size > MAX_MEMBER_BYTES:
                        raise TarSourceError(f"{path}: member {name} declares {member.size} bytes, more than the "
                                             f"{MAX_MEMBER_BYTES} a sample's file may hold")
                    yield member.name, tar.extractfile(member).read() if wanted(member.name) else None
                    where, last = f"in or after member {name}", name  # tarfile checks the data when it skips it
                end = stream.block(tar.offset)
    except TarSourceError:
        raise
    except _READ_ERRORS as e:
        reason = str(e) or type(e).__name__
        raise TarSourceError(f"{path}: cannot read the archive {where} ({reason}): a damaged or cut tar") from None
    if end is not None and end != bytes(_HEADER):  # tarfile ends quietly at a cut or damaged header
        raise TarSourceError(f"{path}: the archive ends {f'after member {last}' if last else 'before any member'} "
                             f"without its end-of-archive block: a damaged or cut tar")


def _samples(path: str, wanted: tuple[str, ...]) -> Iterator[dict]:
    """The samples of one tar in order, by webdataset's rule (KEY.EXT members in a row make one sample):
    {"__key__": key, ext: data (for the extensions wanted, else None)}.
    A key given twice, in a row or not, is refused."""
    base_plus_ext = _base_plus_ext()
    sample: dict | None = None
    seen: set[str] = set()

    def wants(name: str) -> bool:
        return (base_plus_ext(name)[1] or "").lower() in wanted

    for name, data in _members(path, wants):
        key, ext = base_plus_ext(name)
        if key is None:
            continue  # no extension: webdataset skips it too
        ext = ext.lower()
        if sample is not None and key == sample["__key__"]:
            if ext in sample:
                raise TarSourceError(f"{path}: member {shown(name)}: sample {shown(key)} has its .{ext} twice")
        else:
            if sample is not None:
                yield sample
            if key in seen:
                raise TarSourceError(f"{path}: member {shown(name)}: sample {shown(key)} appears a second time, "
                                     f"after other samples")
            seen.add(key)
            sample = {"__key__": key}
        sample[ext] = data
    if sample is not None:
        yield sample


def _class(sample: dict, path: str, label_map: dict[str, int] | None = None) -> int | None:
    """The sample's class from KEY.cls (a decimal integer) or KEY.json ({"label": n} or {"class": n}); with a
    label_map ({name: class}), the class that maps the name they give."""
    where = f"{path}: sample {shown(sample['__key__'])}"
    label = None
    if "cls" in sample:
        text = sample["cls"].decode("ascii", "replace").strip()
        label = int(text) if text.isdigit() and len(text) <= bounded_json.MAX_INT_DIGITS else text
    elif "json" in sample:
        meta = _sidecar(sample, path)
        label = meta.get("label", meta.get("class")) if isinstance(meta, dict) else None
    if label is not None and label_map is not None:
        if str(label) not in label_map:
            raise TarSourceError(f"{where} has class {str(label)[:40]!r}, which the label map does not name")
        label = label_map[str(label)]
    if label is not None and not is_class(label):
        raise TarSourceError(f"{where} has class {shown(str(label)[:40])}, not a non-negative integer of at most "
                             f"{bounded_json.MAX_INT_DIGITS} digits")
    return label


def _sidecar(sample: dict, path: str) -> object:
    """The parsed KEY.json of a sample that has one."""
    try:
        return bounded_json.parse(sample["json"], f"{path}: member {shown(sample['__key__'])}.json")
    except bounded_json.JSONFileError as e:
        raise TarSourceError(str(e)) from None


def _caption(sample: dict, path: str) -> str | None:
    """The sample's caption from KEY.txt (UTF-8), else KEY.json's "text", else its "caption"; None without any."""
    where = f"{path}: member {shown(sample['__key__'])}"
    if "txt" in sample:
        return caption_text(sample["txt"], f"{where}.txt")
    meta = _sidecar(sample, path) if "json" in sample else None
    if not isinstance(meta, dict):
        return None
    key = next((key for key in ("text", "caption") if key in meta), None)
    return None if key is None else check_caption(meta[key], f'{where}.json "{key}"')


class TarSource:
    """The samples of tar shards: count, classes (None when unlabeled), captions (None when uncaptioned: _caption
    says where they come from), and images by position; alpha and background are read_image's (transparency dropped,
    kept or composited), and transparent holds the positions read whose image had transparent pixels."""

    def __init__(self, spec: str | os.PathLike, transform: Callable[[np.ndarray], np.ndarray], alpha: str = "drop",
                 background: tuple[int, int, int] = BACKGROUNDS["white"], label_map: dict[str, int] | None = None):
        self.spec, self.paths, self.transform = str(spec), tar_paths(spec), transform
        self.alpha, self.background, self.transparent = alpha, background, set()
        self.classes = label_map  # the class names, where a label map gave them
        self.counts, labels, captions = [], [], []
        for path in self.paths:
            count = 0
            for sample in _samples(path, tuple({*LABEL_KEYS, *CAPTION_KEYS})):
                if not any(key in sample for key in IMAGE_KEYS):
                    raise TarSourceError(f"{path}: sample {shown(sample['__key__'])} has no image "
                                         f"({', '.join(IMAGE_KEYS)})")
                labels.append(_class(sample, path, label_map))
                if (labels[-1] is None) != (labels[0] is None):
                    raise TarSourceError(f"{path}: sample {shown(sample['__key__'])} has "
                                         f"{'no' if labels[-1] is None else 'a'} class (cls or json 'label'), "
                                         f"the first sample {'has' if labels[-1] is None else 'none'}")
                captions.append(_caption(sample, path))
                if (captions[-1] is None) != (captions[0] is None):
                    raise CaptionError(f"{path}: sample {shown(sample['__key__'])} has "
                                       f"{'no' if captions[-1] is None else 'a'} caption (txt, or json 'text' or "
                                       f"'caption'), the first sample {'has' if captions[-1] is None else 'none'}")
                count += 1
            self.counts.append(count)
        if not labels:
            raise TarSourceError(f"{self.spec}: the tar files hold no samples")
        self.labels = None if labels[0] is None else np.array(labels, dtype=np.int64)
        self.captions: list[str] | None = None if captions[0] is None else captions
        self.label_dim = 0 if self.labels is None else int(self.labels.max()) + 1
        self.starts = np.cumsum([0] + self.counts)
        # The position after the last sample read, the samples from there on, and that last (tar, sample).
        self._reading: tuple[int, Iterator[tuple[str, dict]], tuple[str, dict] | None] | None = None
        self.image_shape = list(self.pixels(0, 1).shape[1:])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _from(self, k: int) -> Iterator[tuple[str, dict]]:
        """(tar, sample) of every sample from the first of tar k on, each tar read once, in order."""
        for path in self.paths[k:]:
            for sample in _samples(path, IMAGE_KEYS):
                yield path, sample

    def _sample(self, position: int) -> tuple[str, dict]:
        """The tar and sample at a position: the last one read again, read on from it, or read anew from its tar
        when before it."""
        if self._reading is not None and self._reading[0] == position + 1:
            return self._reading[2]
        if self._reading is None or self._reading[0] > position:
            if self._reading is not None:
                self._reading[1].close()
            k = int(np.searchsorted(self.starts, position, side="right")) - 1
            self._reading = int(self.starts[k]), self._from(k), None
        at, samples, found = self._reading
        for _ in range(position + 1 - at):
            found = next(samples, None)
            if found is None:
                raise TarSourceError(f"{self.spec}: holds fewer than the {len(self)} samples it held when listed "
                                     f"(changed since)")
        self._reading = position + 1, samples, found
        return found

    def pixels(self, first: int, n: int) -> np.ndarray:
        """Samples [first, first + n) as uint8 NCHW, transformed; every one of the first's shape."""
        out = []
        for position in range(first, first + n):
            image, transparent = self._image(*self._sample(position))
            if transparent:
                self.transparent.add(position)
            out.append(image)
        shapes = {image.shape for image in out}
        if len(shapes) > 1 or (hasattr(self, "image_shape") and list(out[0].shape) != self.image_shape):
            raise TarSourceError(f"{self.spec}: images of shapes {sorted(shapes)} among samples {first} to "
                                 f"{first + n - 1}; mixed sizes (use --resolution and --transform)")
        return np.stack(out)

    def _image(self, path: str, sample: dict) -> tuple[np.ndarray, bool]:
        data = next(sample[key] for key in IMAGE_KEYS if key in sample)
        try:
            with open_image(io.BytesIO(data)):  # refuses a header of too many pixels before decoding
                pass
            image, transparent = read_image(data, alpha=self.alpha, background=self.background)
            image = self.transform(image)
        except IMAGE_ERRORS as e:
            raise TarSourceError(f"{path}: cannot read the image of sample {shown(sample['__key__'])} "
                                 f"({e})") from None
        return image.transpose(2, 0, 1), transparent
