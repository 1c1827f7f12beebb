"""The files of a dataset (a directory or ZIP) read within bounds, and the headers of its images.

What a hostile file declares (a ZIP member's size, an image's pixels, a .npy array's shape) is checked before
anything of that size is allocated; edm2/data/dataset.py reads datasets through these.
"""

from __future__ import annotations

import collections
import importlib.util
import io
import os
import warnings
import zipfile
from pathlib import Path
from typing import IO

import numpy as np
import PIL.Image

from edm2.errors import EDM2Error, shown
from edm2.runtime import files

# Bounds on what a file may declare, checked before anything of that size is allocated. 8192x8192 pixels is far
# beyond what diffusion models train on and stays below PIL's own decompression-bomb warning (89M pixels);
# 512 MiB holds any uncompressed image of that many pixels at up to 8 bytes per pixel (16-bit RGBA).
MAX_IMAGE_PIXELS = 1 << 26
MAX_FILE_BYTES = 1 << 29
# Deflate compresses at most 1032:1; a ZIP member declaring more is a bomb (bzip2/LZMA) or lies about its size.
MAX_ZIP_RATIO = 1100
# The compression methods Python's zipfile reads: bzip2 and LZMA only when Python was built with their modules.
_ZIP_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate",
                **({zipfile.ZIP_BZIP2: "bzip2"} if importlib.util.find_spec("bz2") else {}),
                **({zipfile.ZIP_LZMA: "LZMA"} if importlib.util.find_spec("lzma") else {})}
# What PIL raises for files that are not (complete) images; SyntaxError comes from broken PNG chunks.
IMAGE_ERRORS = (OSError, ValueError, SyntaxError, zipfile.BadZipFile, PIL.Image.DecompressionBombError)


class DatasetError(EDM2Error):
    """A dataset that cannot be used; the message names its path and what is wrong."""


class TooManyPixelsError(DatasetError, ValueError):
    """An image whose header declares more than MAX_IMAGE_PIXELS pixels. A ValueError too, so that every reader
    reports it as it reports an image PIL cannot read (IMAGE_ERRORS), naming the file."""


def walk_files(root: Path) -> list[str]:
    """Relative paths of the files below root, following symlinked folders; a link back to a folder above it (a
    loop) is not followed."""
    names: list[str] = []
    above = {str(root): frozenset()}  # each folder's ancestors, as (device, inode)
    for folder, dirs, fnames in os.walk(root, followlinks=True):
        ancestors = above.pop(folder)
        stat = os.stat(folder)
        if (stat.st_dev, stat.st_ino) in ancestors:
            dirs[:] = []
            continue
        ancestors = ancestors | {(stat.st_dev, stat.st_ino)}
        above.update((os.path.join(folder, name), ancestors) for name in dirs)
        names += [Path(folder, name).relative_to(root).as_posix() for name in fnames]
    return names


class FileTree:
    """Read-only files of a directory or ZIP, usable from several processes (each opens the ZIP itself)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._zip: zipfile.ZipFile | None = None
        self._zip_pid: int | None = None
        if self.path.is_dir():
            self.is_zip = False
            names = walk_files(self.path)
        elif os.path.lexists(self.path) and not self.path.is_file():
            raise DatasetError(f"{self.path}: {files.file_kind(self.path)}, not a directory or ZIP file")
        elif self.path.is_file():
            self.is_zip = True
            names = [name for name in self._archive().namelist() if not name.endswith("/")]
            twice = next((name for name, count in collections.Counter(names).items() if count > 1), None)
            if twice is not None:
                # zipfile reads the last of them under that name; which image the user meant is unknowable.
                raise DatasetError(f"{self.path}: holds the member {shown(twice)} twice; a dataset names each file once")
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

    def read(self, name: str, limit: int = MAX_FILE_BYTES) -> bytes:
        """The bytes of one file, named by its relative path; a file of more than `limit` bytes is refused
        (a ZIP member by its declared size and compression ratio, before anything is inflated)."""
        if self.is_zip:
            info = self._member(name)
            if info.file_size > MAX_ZIP_RATIO * max(info.compress_size, 1):
                raise DatasetError(f"{self.path}: {shown(name)} declares {info.file_size} bytes from {info.compress_size} "
                                   f"compressed, more than deflate's 1032:1; a decompression bomb")
            if info.file_size > limit:
                raise DatasetError(f"{self.path}: {shown(name)} declares {info.file_size} bytes, more than the {limit} "
                                   f"a dataset file may hold")
            stream = self._archive().open(info)  # reads no more than the declared size (then checks the CRC)
        else:
            stream = files.open_input(self.path / name)
        with stream:
            data = stream.read(limit + 1)  # a file may grow after listing; never more than limit + 1 bytes
        if len(data) > limit:
            raise DatasetError(f"{self.path}: {shown(name)} holds more than the {limit} bytes a dataset file may hold")
        return data

    def open(self, name: str) -> IO[bytes]:
        """One file as a binary stream, to read its header without the rest."""
        return self._archive().open(self._member(name)) if self.is_zip else files.open_input(self.path / name)

    def _member(self, name: str) -> zipfile.ZipInfo:
        """The ZIP member `name`, refused (DatasetError naming it) when it is encrypted or compressed by a method
        zipfile cannot read: zipfile would raise RuntimeError or NotImplementedError only when reading it."""
        info = self._archive().getinfo(name)
        if info.flag_bits & 0x1:
            raise DatasetError(f"{self.path}: {name} is encrypted; a dataset's files must be readable without a "
                               f"password")
        if info.compress_type not in _ZIP_METHODS:
            raise DatasetError(f"{self.path}: {name} is compressed with method {info.compress_type}, which this "
                               f"Python cannot read; use {' or '.join(_ZIP_METHODS.values())}")
        return info

    def close(self) -> None:
        """Close the ZIP file if this process opened it."""
        if self._zip is not None and self._zip_pid == os.getpid():
            self._zip.close()
        self._zip = None

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _zip=None, _zip_pid=None)


def open_image(stream: IO[bytes]) -> PIL.Image.Image:
    """PIL's image of a stream with only its header read, refused (TooManyPixelsError) when it declares more
    than MAX_IMAGE_PIXELS pixels: before anything of that size is allocated."""
    with warnings.catch_warnings():
        # PIL warns on stderr above 89M pixels; such an image is refused just below, in one line.
        warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
        image = PIL.Image.open(stream)
    if image.width * image.height > MAX_IMAGE_PIXELS:
        image.close()
        raise TooManyPixelsError(f"its header declares {image.width}x{image.height} pixels, more than the "
                                 f"{MAX_IMAGE_PIXELS} an image may have")
    return image


def npy_header(data: bytes) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, Fortran order, dtype, offset of the values) of .npy bytes, without building the array.

    ValueError for what is not a .npy file of format 1.0 or 2.0 (3.0 differs only for non-Latin-1 field names).
    """
    stream = io.BytesIO(data)
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    else:
        raise ValueError(f".npy format version {version[0]}.{version[1]} is not supported")
    return shape, fortran, dtype, stream.tell()
