"""Writing release-format datasets: files under release names, dataset.json, one atomic rename at the end."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import PIL.Image

from edm2.data.captions import CAPTIONS_KEY, CaptionError, captions_record
from edm2.data.dataset_json import CLASSES_KEY, LABELS_FILE
from edm2.runtime import files

# A fixed timestamp keeps ZIP bytes identical between runs that write identical files.
_ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)


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


def labels_json(labels: dict[str, int | None], classes: dict[str, int] | None = None,
                encoding: dict | None = None, captions: dict[str, str | None] | None = None) -> str:
    """dataset.json text: every file's class, or null unless every file has one (as the release); with classes,
    also the class names ({name: class}, under CLASSES_KEY, which the release's readers ignore); what the files
    hold, {"encoding": name, "encoding_settings": {...}} (edm2.encoders.ENCODINGS), when given; and every file's
    caption (CAPTIONS_KEY: [[name, caption], ...]) when some file has one, which every file then must."""
    complete = len(labels) > 0 and all(label is not None for label in labels.values())
    stored = {"labels": [[name, int(label)] for name, label in labels.items()] if complete else None}
    if classes is not None and complete:
        stored[CLASSES_KEY] = classes
    captioned = {name: text for name, text in (captions or {}).items() if text is not None}
    if captioned:
        if len(captioned) < len(labels):
            missing = next(name for name in labels if name not in captioned)
            raise CaptionError(f"{missing} has no caption, but other images have one; a dataset captions all or none")
        stored[CAPTIONS_KEY] = captions_record(captioned)
    return json.dumps({**stored, **(encoding or {})})


def is_zip_path(path: str | os.PathLike) -> bool:
    """True when a dataset path names a ZIP file rather than a directory."""
    return str(path).lower().endswith(".zip")


def write_failure(path: str | os.PathLike, error: OSError) -> files.OutputError:
    """An OutputError naming the output a write failed for (a full disk's OSError names no file)."""
    return files.OutputError(f"{path}: cannot write ({error.strerror or error})")


class DatasetWriter:
    """Collects files and labels of a dataset being written; see dataset_writer()."""

    def __init__(self, dest: Path, add_file: Callable[[str, bytes], None]):
        self.dest = dest
        self._add_file = add_file
        self.labels: dict[str, int | None] = {}
        self.classes: dict[str, int] | None = None  # class names, written to dataset.json beside the labels
        self.encoding: dict | None = None  # dataset.json's "encoding" and "encoding_settings", set by the caller
        self.captions: dict[str, str | None] = {}

    def add(self, fname: str, data: bytes, label: int | None = None, caption: str | None = None) -> None:
        """Store one image file under its release name with its class (None for unlabeled) and its caption (None
        for uncaptioned)."""
        try:
            self._add_file(fname, data)
        except OSError as e:
            raise write_failure(self.dest, e) from None
        self.labels[fname] = label
        self.captions[fname] = caption

    def dataset_json(self) -> str:
        """The dataset.json text of the files added (labels_json)."""
        return labels_json(self.labels, self.classes, self.encoding, self.captions)


def write_zip_member(archive: zipfile.ZipFile, fname: str, data: bytes | str) -> None:
    """Add an uncompressed member with a fixed timestamp, so equal inputs give equal ZIP bytes."""
    info = zipfile.ZipInfo(fname, date_time=_ZIP_DATE_TIME)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    archive.writestr(info, data)


@contextlib.contextmanager
def dataset_writer(dest: str | os.PathLike) -> Iterator[DatasetWriter]:
    """Write a dataset to a temporary ZIP or directory, add dataset.json, and rename onto dest on success.

    The temporary is named like files.atomic_path's (.DEST.PID@HOST.RANDOM.tmp); a folder that a killed run left
    is never removed by files.remove_stale_temporaries (no folder is): dataset_tool.py names it. A failed write is
    an OutputError.
    """
    dest = Path(dest)
    if is_zip_path(dest):
        with _zip_writer(dest) as writer:
            yield writer
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = files.new_temporary(dest, folder=True)
    try:
        tmp.chmod(0o777 & ~files.current_umask())  # new_temporary makes the folder private
        writer = DatasetWriter(dest, lambda fname, data: _write_file(tmp / fname, data))
        yield writer
        try:
            (tmp / LABELS_FILE).write_text(writer.dataset_json())
        except OSError as e:
            raise write_failure(dest, e) from None
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _zip_writer(dest: Path) -> Iterator[DatasetWriter]:
    with files.atomic_path(dest) as tmp:
        archive = zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED)
        writer = DatasetWriter(dest, lambda fname, data: write_zip_member(archive, fname, data))
        try:
            yield writer
        except BaseException:
            _abandon(archive)
            raise
        try:
            write_zip_member(archive, LABELS_FILE, writer.dataset_json())
            archive.close()
        except OSError as e:
            _abandon(archive)
            raise write_failure(dest, e) from None


def _abandon(archive: zipfile.ZipFile) -> None:
    """Close a ZIP that will be deleted; its directory may not fit on a full disk, which no longer matters."""
    with contextlib.suppress(OSError):
        archive.close()


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
