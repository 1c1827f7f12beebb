"""Files trusted by their SHA-256 alone: verified before any parser sees a byte, and the bytes verified are the
bytes returned.

A checker that reads a file with one parser while the loader reads it with another is no defence: the two can
be made to disagree (a ZIP archive with two central directories is harmless to Python's zipfile and hostile to
torch's reader). A digest of the raw bytes involves no parser, so a file whose digest is the published one is the
published file, whatever any reader makes of it.
"""

from __future__ import annotations

import hashlib
import os
from typing import BinaryIO

from edm2.errors import EDM2Error
from edm2.runtime import files

CHUNK_BYTES = 1 << 20


class PinnedFileError(EDM2Error):
    """A file's bytes are not the ones pinned by a SHA-256 (or changed while being read)."""


def stream_sha256(file: BinaryIO) -> tuple[str, int]:
    """(SHA-256 in hex, byte count) of what remains of an open file, read in 1 MiB chunks (memory: one chunk)."""
    digest, size = hashlib.sha256(), 0
    while chunk := file.read(CHUNK_BYTES):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def read_pinned(path: str | os.PathLike, sha256: str) -> bytes:
    """The bytes of the file at `path` if their SHA-256 is `sha256`; PinnedFileError otherwise.

    Two passes over one open file: the first hashes without keeping anything, so a file of any size costs one
    chunk of memory to refuse; only a file with the pinned digest is then read into memory (at most as many bytes
    as the first pass counted) and hashed again, so what the caller parses is exactly what was verified even if
    the file is replaced or rewritten meanwhile.
    """
    with files.open_input(path) as file:
        digest, size = stream_sha256(file)
        if digest != sha256:
            raise PinnedFileError(f"its SHA-256 is {digest}, not {sha256}")
        file.seek(0)
        data = file.read(size + 1)
    if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
        raise PinnedFileError("it changed while being read")
    return data
