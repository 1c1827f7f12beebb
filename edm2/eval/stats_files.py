"""Reference statistics files: ours (.npz of '<metric>/mu', '<metric>/sigma', optionally '<metric>/features'), the
release's .pkl, and EDM's .npz."""

from __future__ import annotations

import codecs
import collections
import math
import os
import pickle
import zipfile
from pathlib import Path
from typing import IO, Mapping

import numpy as np

from edm2.errors import EDM2Error
from edm2.eval.metrics import Stats
from edm2.formats import safe_pickle
from edm2.runtime import files


class StatsError(EDM2Error):
    """A statistics file is missing, malformed, non-finite, or carries code; the message names the file."""


class NotStatisticsError(StatsError):
    """A folder or ZIP of images (a dataset) was given where a statistics file belongs."""


# The widest features statistics may hold: four times the widest detector's (Inception, 2048), so that a
# covariance never exceeds 512 MiB whatever a file declares.
MAX_FEATURES = 8192
# The most features a reference file may keep per metric for precision, recall, density, coverage and KID
# (edm2.eval.prdc): Kynkaanniemi et al.'s 50,000 and some, 400 MiB of float32 Inception features at most.
MAX_KEPT_FEATURES = 65536
# .npy header versions NumPy writes for our arrays (3.0 only adds UTF-8 field names, which arrays of numbers lack).
_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}

# What a statistics pickle (the release's format) may name: NumPy arrays and plain containers.
_STATS_GLOBALS = {**safe_pickle.numpy_globals(), ("_codecs", "encode"): codecs.encode,
                  ("collections", "OrderedDict"): collections.OrderedDict}


def _checked_features(features: object, dim: int, metric: str, source: str) -> np.ndarray:
    """A metric's kept features [N, D]: 2 <= N <= MAX_KEPT_FEATURES, D the statistics' width, finite."""
    try:
        features = np.asarray(features, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise StatsError(f"{source}: metric '{metric}' has features that are not numbers ({e})") from None
    if features.ndim != 2 or features.shape[1] != dim or not 2 <= features.shape[0] <= MAX_KEPT_FEATURES:
        raise StatsError(f"{source}: metric '{metric}' has features {features.shape}; expected [N, {dim}] with "
                         f"2 <= N <= {MAX_KEPT_FEATURES}")
    if not np.isfinite(features).all():
        raise StatsError(f"{source}: metric '{metric}' has features that are not finite (NaN or infinity)")
    return features


def _checked_stats(raw: object, source: str) -> Stats:
    """Validate {metric: {'mu': [D], 'sigma': [D, D], optional 'features': [N, D]}}, finite, D <= MAX_FEATURES
    (other top-level entries, e.g. 'num_images', are ignored)."""
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
        if mu.ndim != 1 or sigma.shape != (mu.shape[0], mu.shape[0]) or not 0 < mu.shape[0] <= MAX_FEATURES:
            raise StatsError(f"{source}: metric '{metric}' has mu {mu.shape} and sigma {sigma.shape}; "
                             f"expected [D] and [D, D] with 0 < D <= {MAX_FEATURES}")
        if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
            raise StatsError(f"{source}: metric '{metric}' has a mu or sigma that is not finite (NaN or infinity)")
        stats[str(metric)] = {"mu": mu, "sigma": sigma}
        if "features" in entry:
            stats[str(metric)]["features"] = _checked_features(entry["features"], mu.shape[0], metric, source)
    if not stats:
        raise StatsError(f"{source}: holds no metric statistics")
    return stats


def _read_npy(archive: zipfile.ZipFile, info: zipfile.ZipInfo, source: str) -> np.ndarray:
    """One numeric array of an .npz; its header is checked against the bounds and against the bytes the member
    holds before anything is allocated for it."""
    where = f"{source}: {info.filename}"
    with archive.open(info) as member:
        try:
            reader = _NPY_HEADERS.get(np.lib.format.read_magic(member))
            if reader is None:
                raise ValueError("a .npy version NumPy does not write for numbers")
            shape, fortran_order, dtype = reader(member)
        except ValueError as e:
            raise StatsError(f"{where} is not a .npy array ({e})") from None
        if dtype.hasobject or dtype.kind not in "fiu":
            raise StatsError(f"{where} holds {dtype}, not numbers")
        # Kept features [N, D] may be longer than wide (MAX_KEPT_FEATURES rows); the rest is [D] or [D, D].
        bounds = (MAX_KEPT_FEATURES, MAX_FEATURES) if info.filename.endswith("/features.npy") else (MAX_FEATURES,) * 2
        if not 1 <= len(shape) <= 2 or not all(0 < n <= bound for n, bound in zip(shape, bounds)):
            raise StatsError(f"{where} declares shape {shape}; statistics are [D] or [D, D] and kept features "
                             f"[N, D], with 0 < D <= {MAX_FEATURES} and 0 < N <= {MAX_KEPT_FEATURES}")
        size = math.prod(shape) * dtype.itemsize
        if size != info.file_size - member.tell():
            raise StatsError(f"{where} declares {size} bytes of data ({shape}, {dtype}) but holds "
                             f"{info.file_size - member.tell()}")
        data = member.read(size + 1)
    if len(data) != size:
        raise StatsError(f"{where} holds {len(data)} bytes of data, not the {size} its size says")
    return np.frombuffer(data, dtype).reshape(shape, order="F" if fortran_order else "C")


def _read_npz(file: IO[bytes], source: str) -> Stats:
    """Our .npz ('<metric>/mu', '<metric>/sigma') or EDM's ('mu', 'sigma': FID only)."""
    try:
        archive = zipfile.ZipFile(file)
        infos = archive.infolist()
        if not all(info.filename.endswith(".npy") for info in infos):  # np.savez writes nothing else; datasets do
            raise NotStatisticsError(f"{source} is a ZIP of images (a dataset), not a statistics file")
        arrays = {info.filename.removesuffix(".npy"): _read_npy(archive, info, source) for info in infos}
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, NotImplementedError) as e:  # CRC, compression, offsets
        raise StatsError(f"{source}: not a readable .npz of numeric arrays ({e})") from None
    if set(arrays) == {"mu", "sigma"}:  # EDM's reference files hold FID statistics only
        return _checked_stats({"fid": arrays}, source)
    nested: dict[str, dict[str, np.ndarray]] = {}
    for key, value in arrays.items():
        metric, _, field = key.rpartition("/")
        nested.setdefault(metric, {})[field] = value
    return _checked_stats(nested, source)


def load_stats(path_or_url: str | os.PathLike) -> Stats:
    """Read statistics as {metric: {'mu', 'sigma'}} from our .npz, EDM's .npz (-> 'fid') or the release's .pkl;
    each array finite and at most MAX_FEATURES wide."""
    source = str(path_or_url)
    path = files.cached_path(path_or_url)
    if path.is_dir():
        raise NotStatisticsError(f"{source} is a folder (of images?), not a statistics file")
    try:
        with files.open_input(path) as file:
            is_zip = file.read(4) == b"PK\x03\x04"  # NumPy .npz is a ZIP archive
            file.seek(0)
            return _read_npz(file, source) if is_zip else _read_pickle(file, source)
    except OSError as e:
        raise StatsError(f"cannot read statistics file {source}: {e.strerror or e}") from None


def _read_pickle(file: IO[bytes], source: str) -> Stats:
    """The release's statistics pickle, read without running code."""
    try:
        raw = safe_pickle.restricted_load(file, _STATS_GLOBALS,
                                          "statistics pickles may hold only NumPy arrays and plain containers")
    except pickle.UnpicklingError as e:
        raise StatsError(f"{source}: {e}") from None
    except Exception as e:  # a malformed pickle can fail in many ways; none of them may escape as a traceback
        raise StatsError(f"{source}: not a statistics pickle ({e.__class__.__name__}: {e})") from None
    return _checked_stats(raw, source)


def save_stats(path: str | os.PathLike, stats: Mapping[str, Mapping[str, np.ndarray]]) -> None:
    """Write statistics atomically: .npz (ours: '<metric>/mu', '<metric>/sigma', with kept features
    '<metric>/features' in float32) or .pkl (the release's format, features as a further entry)."""
    path = Path(path)
    if path.suffix not in (".npz", ".pkl"):
        raise StatsError(f"{path}: statistics files end in .npz (ours) or .pkl (the release's format)")
    clean = {metric: {key: np.asarray(entry[key], dtype=np.float32 if key == "features" else np.float64)
                      for key in ("mu", "sigma", "features") if key in entry}
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
