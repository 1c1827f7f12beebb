"""Blends: several datasets read as one, each in a fixed share of every blend epoch (largest remainders).

A blend is given as PATH:WEIGHT,PATH:WEIGHT or as a JSON file {"sources": [{"path": ..., "weight": ...}, ...]};
the weights need not sum to one, only to a positive number. A source may itself be a blend (a .json spec): its
sources take its share of the outer blend, split by its own weights, in exact fractions (blend_sources).
"""

from __future__ import annotations

import math
import os
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np

from edm2.data.dataset import ImageData, LabelsOf
from edm2.data.dataset_files import DatasetError
from edm2.runtime import bounded_json

MAX_SOURCES = 1024
MAX_NESTING = 16  # blends within blends: far beyond any real layout, well within the recursion limit
# A blend epoch's samples are int64 counts (below 2**63): a weight sum up to this keeps total * weight a finite float.
MAX_WEIGHT_SUM = sys.float_info.max / 2**63


class BlendError(DatasetError):
    """A blend that cannot be used: malformed, weights that do not sum to a positive number, mixed sources."""


def parse_blend(spec: str) -> list[tuple[str, float]]:
    """(path, weight) of each source of a blend spec (PATH:WEIGHT,... or a .json file)."""
    if spec.lower().endswith(".json") and os.path.lexists(spec):  # any kind: bounded_json refuses a FIFO
        try:
            sources = bounded_json.read(spec)["sources"]
            pairs = [(str(s["path"]), s["weight"]) for s in sources]
        except (OSError, bounded_json.JSONFileError, KeyError, TypeError) as e:
            raise BlendError(f"{spec}: not a blend ({{\"sources\": [{{\"path\": ..., \"weight\": ...}}]}}; "
                             f"{type(e).__name__}: {e})") from None
        base = Path(spec).parent  # relative paths are relative to the spec
        pairs = [(str(base / path) if not os.path.isabs(path) else path, weight) for path, weight in pairs]
    else:
        pairs = []
        for part in spec.split(","):
            path, sep, weight = part.rpartition(":")
            try:
                pairs.append((path, float(weight)))
            except ValueError:
                raise BlendError(f"{part!r} is not PATH:WEIGHT") from None
            if not sep or not path:
                raise BlendError(f"{part!r} is not PATH:WEIGHT")
    check_weights([weight for _, weight in pairs])
    return pairs


def check_weights(weights: list) -> None:
    """Refuse weights that are not finite non-negative numbers summing to a positive number of at most
    MAX_WEIGHT_SUM (a float sum that overflows is refused too)."""
    if not 1 <= len(weights) <= MAX_SOURCES:
        raise BlendError(f"a blend has 1 to {MAX_SOURCES} sources, not {len(weights)}")
    bad = [w for w in weights if isinstance(w, bool) or not isinstance(w, (int, float, Fraction))
           or not math.isfinite(w) or w < 0]
    if bad:
        raise BlendError(f"weight {bad[0]!r} is not a finite non-negative number")
    total = sum(weights)
    if total <= 0:
        raise BlendError(f"the weights {weights} sum to {total}, not a positive number")
    if not total <= MAX_WEIGHT_SUM:
        raise BlendError(f"the weights {weights} sum to {float(total):g}, more than {MAX_WEIGHT_SUM:.3g}; weights "
                         f"are relative, so scale them down")


def is_blend(spec: str) -> bool:
    """True for a blend spec: a .json file, or PATH:WEIGHT[,PATH:WEIGHT...] that names no existing path."""
    if spec.lower().endswith(".json"):
        return True
    return not os.path.exists(spec) and ":" in spec


def blend_sources(spec: str) -> list[tuple[str, float | Fraction]]:
    """(path, weight) of each dataset a blend spec reads: parse_blend's pairs where no source is a blend; else every
    source that is a blend replaced by its own sources, each weighing the blend's share of its outer blend times its
    share of that blend, in exact fractions. BlendError for a blend that names itself, directly or through others."""
    return _sources(spec, ())


def _sources(spec: str, chain: tuple[tuple[str, str], ...]) -> list[tuple[str, float | Fraction]]:
    """blend_sources of spec, read within the blends of chain ((real path, spec) of each, outermost first)."""
    real = os.path.realpath(spec) if os.path.isfile(spec) else None
    if real is not None and real in [path for path, _ in chain]:
        cycle = [name for _, name in chain[[path for path, _ in chain].index(real):]] + [spec]
        raise BlendError(f"the blend {cycle[0]} names itself ({' -> '.join(cycle)}); a blend's sources are datasets "
                         "or other blends")
    if len(chain) >= MAX_NESTING:
        raise BlendError(f"{spec}: blends nested more than {MAX_NESTING} deep ({chain[0][1]} -> ...)")
    pairs = parse_blend(spec)
    if not any(is_blend(path) for path, _ in pairs):
        return pairs
    # Shares multiply exactly as fractions (a float product would round them off the composed shares).
    total, found = sum(Fraction(weight) for _, weight in pairs), []
    for path, weight in pairs:
        share = Fraction(weight) / total
        if is_blend(path):
            inner = _sources(path, (*chain, (real or spec, spec)))
            inner_total = sum(Fraction(w) for _, w in inner)
            found += [(source, share * Fraction(w) / inner_total) for source, w in inner]
        else:
            found.append((path, share))
        if len(found) > MAX_SOURCES:
            raise BlendError(f"{spec}: more than {MAX_SOURCES} datasets once its blends are read through")
    return found


def segments(sizes: list[int], weights: list[float | Fraction]) -> list[int]:
    """Samples of each source in one blend epoch of sum(sizes) samples: shares by weight, largest remainders
    (exact where the weights are fractions)."""
    total, weight_sum = sum(sizes), sum(weights)
    exact = [total * w / weight_sum for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    return counts


class BlendDataset(ImageData):
    """The sources one after another (item offsets[i] + j is item j of source i); one shape, dtype and labels."""

    def __init__(self, sources: list, weights: list[float | Fraction], names: list[str]):
        check_weights(weights)
        first = sources[0]
        for source, name in zip(sources[1:], names[1:]):
            if source.image_shape != first.image_shape or source[0][0].dtype != first[0][0].dtype:
                raise BlendError(f"{name} holds {source[0][0].dtype} samples of shape {source.image_shape}, "
                                 f"{names[0]} {first[0][0].dtype} of {first.image_shape}; mixed shapes or dtypes")
            if source.encoding != first.encoding or source.encoding_settings != first.encoding_settings:
                raise BlendError(f"{name} records the encoding {source.encoding!r}, {names[0]} {first.encoding!r}; "
                                 f"a blend's sources share their encoding")
            if source.label_dim != first.label_dim:
                raise BlendError(f"{name} has {source.label_dim} classes, {names[0]} {first.label_dim}; a blend's "
                                 f"sources share their classes")
            if source.has_text != first.has_text or (first.has_text and source.text_record != first.text_record):
                raise BlendError(f"{name} and {names[0]} hold text embeddings of different encoders or shapes, or "
                                 f"one holds none; a blend's sources share their text_encoding")
        self.sources, self.weights, self.names = sources, list(weights), names
        self.sizes = [len(s) for s in sources]
        self.offsets = np.cumsum([0] + self.sizes)
        self.segments = segments(self.sizes, self.weights)
        self.path, self.image_shape, self.label_dim = first.path, first.image_shape, first.label_dim
        self.encoding, self.encoding_settings = first.encoding, first.encoding_settings
        self.record_file = first.record_file
        self.raw_labels = None if first.raw_labels is None else LabelsOf(len(self), self.label_of)

    def source_of(self, idx: int) -> tuple[object, int]:
        """The source holding item idx and the item's index there."""
        i = int(np.searchsorted(self.offsets, idx, side="right")) - 1
        return self.sources[i], idx - int(self.offsets[i])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def label_of(self, idx: int) -> int:
        """The class of item idx, read from its source."""
        source, j = self.source_of(idx)
        return int(source.raw_labels[j])

    def __getitem__(self, idx: int) -> tuple[np.ndarray, np.ndarray]:
        source, j = self.source_of(idx)
        return source[j]

    @property
    def has_captions(self) -> bool:
        """True when every source has captions."""
        return all(source.has_captions for source in self.sources)

    def get_caption(self, idx: int) -> str:
        """The caption of item idx, read from its source."""
        if not self.has_captions:
            return super().get_caption(idx)
        source, j = self.source_of(idx)
        return source.get_caption(j)

    @property
    def has_text(self) -> bool:
        """Whether the sources hold cached text embeddings (all or none do)."""
        return self.sources[0].has_text

    @property
    def text_record(self) -> dict:
        """The sources' one "text_encoding" record."""
        return self.sources[0].text_record

    def empty_condition(self) -> np.ndarray:
        """The empty caption's condition, the same encoder's in every source."""
        return self.sources[0].empty_condition()

    def describe(self) -> str:
        """The line a run prints of a blend: how many datasets, and each one's share."""
        return f"Blend of {len(self.sources)} datasets: {self.shares()}"

    def shares(self) -> str:
        """Each source's share of a blend epoch, for the log."""
        epoch = sum(self.segments)
        return "; ".join(f"{name}: {100 * n / epoch:.1f}% ({n} of every {epoch} samples, {size} in the source)"
                         for name, n, size in zip(self.names, self.segments, self.sizes))

    @property
    def name(self) -> str:
        """The sources' names joined by '+'."""
        return "+".join(source.name for source in self.sources)

    def close(self) -> None:
        """Close every source."""
        for source in self.sources:
            source.close()
