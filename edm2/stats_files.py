"""Reference statistics files: ours (.npz of '<metric>/mu', '<metric>/sigma'), the release's .pkl, and EDM's .npz."""

from __future__ import annotations

import codecs
import collections
import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Mapping

import numpy as np

from edm2 import files, safe_pickle
from edm2.errors import EDM2Error
from edm2.metrics import Stats


class StatsError(EDM2Error):
    """A statistics file is missing, malformed, or carries code; the message names the file."""


class NotStatisticsError(StatsError):
    """A folder or ZIP of images (a dataset) was given where a statistics file belongs."""


# What a statistics pickle (the release's format) may name: NumPy arrays and plain containers.
_STATS_GLOBALS = {**safe_pickle.numpy_globals(), ("_codecs", "encode"): codecs.encode,
                  ("collections", "OrderedDict"): collections.OrderedDict}


def _checked_stats(raw: object, source: str) -> Stats:
    """Validate {metric: {'mu': [D], 'sigma': [D, D]}} (other top-level entries, e.g. 'num_images', are ignored)."""
    if not isinstance(raw, Mapping):
        raise StatsError(f"{source}: expected a dict of metrics, found {type(raw).__name__}")
    stats = {}
    for metric, entry in raw.items():
        if not isinstance(entry, Mapping):
            continue
        try:
            mu = np.asarray(entry["mu"], dtype=np.float64)
            sigma = np.asarray(entry["sigma"], dtype=np.float64)
        except (KeyError, TypeError, ValueError) as e:
            raise StatsError(f"{source}: metric '{metric}' lacks a numeric 'mu'/'sigma' ({e})") from None
        if mu.ndim != 1 or sigma.shape != (mu.shape[0], mu.shape[0]):
            raise StatsError(f"{source}: metric '{metric}' has mu {mu.shape} and sigma {sigma.shape}; "
                             "expected [D] and [D, D]")
        stats[str(metric)] = {"mu": mu, "sigma": sigma}
    if not stats:
        raise StatsError(f"{source}: holds no metric statistics")
    return stats


def _read_npz(data: bytes, source: str) -> Stats:
    """Our .npz ('<metric>/mu', '<metric>/sigma') or EDM's ('mu', 'sigma': FID only)."""
    try:
        names = zipfile.ZipFile(io.BytesIO(data)).namelist()
        if not all(name.endswith(".npy") for name in names):  # np.savez writes nothing else; datasets do
            raise NotStatisticsError(f"{source} is a ZIP of images (a dataset), not a statistics file")
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise StatsError(f"{source}: not a readable .npz of numeric arrays ({e})") from None
    if set(arrays) == {"mu", "sigma"}:  # EDM's reference files hold FID statistics only
        return _checked_stats({"fid": arrays}, source)
    nested: dict[str, dict[str, np.ndarray]] = {}
    for key, value in arrays.items():
        metric, _, field = key.rpartition("/")
        nested.setdefault(metric, {})[field] = value
    return _checked_stats(nested, source)


def load_stats(path_or_url: str | os.PathLike) -> Stats:
    """Read statistics as {metric: {'mu', 'sigma'}} from our .npz, EDM's .npz (-> 'fid') or the release's .pkl."""
    source = str(path_or_url)
    path = files.cached_path(path_or_url)
    if path.is_dir():
        raise NotStatisticsError(f"{source} is a folder (of images?), not a statistics file")
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise StatsError(f"cannot read statistics file {source}: {e.strerror or e}") from None
    if data[:4] == b"PK\x03\x04":  # NumPy .npz is a ZIP archive
        return _read_npz(data, source)
    try:
        raw = safe_pickle.restricted_load(io.BytesIO(data), _STATS_GLOBALS,
                                          "statistics pickles may hold only NumPy arrays and plain containers")
    except pickle.UnpicklingError as e:
        raise StatsError(f"{source}: {e}") from None
    except Exception as e:  # a malformed pickle can fail in many ways; none of them may escape as a traceback
        raise StatsError(f"{source}: not a statistics pickle ({e.__class__.__name__}: {e})") from None
    return _checked_stats(raw, source)


def save_stats(path: str | os.PathLike, stats: Mapping[str, Mapping[str, np.ndarray]]) -> None:
    """Write statistics atomically: .npz (ours: '<metric>/mu', '<metric>/sigma') or .pkl (the release's format)."""
    path = Path(path)
    if path.suffix not in (".npz", ".pkl"):
        raise StatsError(f"{path}: statistics files end in .npz (ours) or .pkl (the release's format)")
    clean = {metric: {key: np.asarray(entry[key], dtype=np.float64) for key in ("mu", "sigma")}
             for metric, entry in stats.items()}
    try:
        with files.atomic_path(path) as tmp, open(tmp, "wb") as f:
            if path.suffix == ".npz":
                np.savez(f, **{f"{metric}/{key}": value for metric, entry in clean.items()
                               for key, value in entry.items()})
            else:
                pickle.dump(clean, f)
    except OSError as e:  # a full disk surfaces here; atomic_path has already removed the partial file
        raise StatsError(f"cannot write {path}: {e.strerror or e}") from None
