"""Captions and cached text embeddings in a folder or ZIP dataset (dataset_tool.py encode-text writes them).

Image NNNNN/imgIIIIIIII.png (or its latents NNNNN/img-mean-std-IIIIIIII.npy) has its caption's embeddings in
NNNNN/txtIIIIIIII.npy: float16 [1 + L, D], row 0 pooled, rows 1..L the tokens, zero past the caption's length n.
dataset.json records "captions" [[name, text], ...], "text_encoding" (the encoder's identity, L, D, the pooling),
"text_lengths" [[name, n], ...] and "text_empty_length"; the empty caption's embeddings are text-empty.npy.
"""

from __future__ import annotations

import math
import re

import numpy as np

from edm2.data.dataset_files import DatasetError, FileTree, npy_header
from edm2.data.dataset_json import LABELS_FILE
from edm2.errors import shown
from edm2.text_encoders import MAX_TEXT_DIM, MAX_TOKENS, STORED_DTYPE, condition_of

TEXT_EMPTY_FILE = "text-empty.npy"
TEXT_NAME = re.compile(r"\d{5}/txt\d{8}\.npy")
_IMAGE_NUMBER = re.compile(r"(\d{5})/img(?:-mean-std-)?(\d{8})\.(?:png|npy)")


def is_text_file(name: str) -> bool:
    """Whether a dataset file holds text embeddings (no image of the dataset)."""
    return name == TEXT_EMPTY_FILE or TEXT_NAME.fullmatch(name) is not None


def text_fname(image_name: str) -> str:
    """The embeddings file of a release-named image or latent file: NNNNN/txtIIIIIIII.npy."""
    match = _IMAGE_NUMBER.fullmatch(image_name)
    if match is None:
        raise DatasetError(f"{shown(image_name)} is no release file name (NNNNN/imgIIIIIIII.png); "
                           f"dataset_tool.py convert writes them")
    return f"{match[1]}/txt{match[2]}.npy"


def _count(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


class TextEmbeddings:
    """The cached embeddings of a dataset's images, read and checked against its "text_encoding" record."""

    def __init__(self, files: FileTree, stored: dict, names: list[str]):
        path = files.path
        record = stored.get("text_encoding")
        if not (isinstance(record, dict) and isinstance(record.get("encoder"), dict)
                and _count(record.get("tokens"), 1, MAX_TOKENS) and _count(record.get("dim"), 1, MAX_TEXT_DIM)):
            raise DatasetError(f"{path}: {LABELS_FILE} text_encoding must be {{\"encoder\": {{...}}, \"tokens\": L "
                               f"in [1, {MAX_TOKENS}], \"dim\": D in [1, {MAX_TEXT_DIM}], ...}}")
        self.files, self.record = files, record
        self.tokens, self.dim = record["tokens"], record["dim"]
        listed = stored.get("text_lengths")
        if not isinstance(listed, list) or not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                                                   and _count(e[1], 0, self.tokens) for e in listed):
            raise DatasetError(f"{path}: {LABELS_FILE} text_lengths must be [name, n] pairs with n in "
                               f"[0, {self.tokens}]")
        lengths = dict(listed)
        missing = [name for name in names if name not in lengths]
        if missing:
            raise DatasetError(f"{path}: {LABELS_FILE} has no text length for {shown(missing[0])} "
                               f"({len(missing)} images without one)")
        self.lengths = [lengths[name] for name in names]
        self.empty_length = stored.get("text_empty_length")
        if not _count(self.empty_length, 0, self.tokens):
            raise DatasetError(f"{path}: {LABELS_FILE} text_empty_length must be an integer in [0, {self.tokens}]")
        self.names = names

    def embeddings(self, name: str) -> np.ndarray:
        """float16 [1 + L, D] of one embeddings file, its header checked against the record before reading on."""
        shape = (1 + self.tokens, self.dim)
        size = math.prod(shape) * np.dtype(STORED_DTYPE).itemsize
        data = self.files.read(name, limit=size + 4096)  # a .npy header is at most a few hundred bytes
        try:
            header_shape, fortran, dtype, offset = npy_header(data)
        except ValueError as e:
            raise DatasetError(f"{self.files.path}: {shown(name)} is no .npy file ({e})") from None
        if tuple(header_shape) != shape or dtype != STORED_DTYPE or fortran or len(data) - offset != size:
            raise DatasetError(f"{self.files.path}: {shown(name)} holds {dtype} {header_shape} in {len(data) - offset} "
                               f"bytes; the text_encoding record says float16 {shape}")
        values = np.frombuffer(data, STORED_DTYPE, offset=offset).reshape(shape)
        if not np.isfinite(values).all():
            raise DatasetError(f"{self.files.path}: {shown(name)} holds non-finite values (NaN or infinity)")
        return values

    def condition(self, raw_idx: int) -> np.ndarray:
        """float32 [1 + L, D + 1] condition of image raw_idx (edm2.text_condition)."""
        return condition_of(self.embeddings(text_fname(self.names[raw_idx])), self.lengths[raw_idx])

    def empty_condition(self) -> np.ndarray:
        """float32 [1 + L, D + 1] condition of the empty caption."""
        return condition_of(self.embeddings(TEXT_EMPTY_FILE), self.empty_length)
