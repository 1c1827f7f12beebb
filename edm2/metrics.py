"""Feature statistics across ranks, the Frechet distance, and statistics files (ours, the release's, EDM's)."""

from __future__ import annotations

import codecs
import collections
import io
import os
import pickle
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
import scipy.linalg
import torch
import torch.utils.data
import tqdm

from edm2 import distributed, files, safe_pickle

Stats = dict[str, dict[str, np.ndarray]]


class StatsError(ValueError):
    """A statistics file is missing, malformed, or carries code; the message names the file."""


class FeatureStats:
    """Running float64 sum and sum of outer products of features; all-reduced across ranks at the end."""

    def __init__(self, dim: int, device: torch.device | str = "cpu"):
        self.sum = torch.zeros([dim], dtype=torch.float64, device=device)
        self.outer = torch.zeros([dim, dim], dtype=torch.float64, device=device)
        self.count = torch.zeros([], dtype=torch.float64, device=device)

    def add(self, features: torch.Tensor) -> None:
        """Accumulate a batch of features [N, dim]."""
        f = features.to(device=self.sum.device, dtype=torch.float64)
        self.sum += f.sum(0)
        self.outer.addmm_(f.T, f)
        self.count += f.shape[0]

    def finalize(self) -> tuple[dict[str, np.ndarray], int]:
        """({'mu', 'sigma'}, number of features) over all ranks; every rank must call it."""
        total = distributed.all_reduce_sum(torch.cat([self.sum, self.outer.flatten(), self.count[None]]))
        dim = self.sum.shape[0]
        n = int(total[-1].item())
        if n < 2:
            raise ValueError(f"need at least 2 images for statistics, got {n}")
        mu = total[:dim] / n
        # Unbiased covariance (divide by n - 1), as the release and StyleGAN3's metrics compute it.
        sigma = (total[dim:-1].reshape(dim, dim) - torch.outer(mu, mu) * n) / (n - 1)
        return {"mu": mu.cpu().numpy(), "sigma": sigma.cpu().numpy()}, n


def calculate_stats(batches: Iterable[torch.Tensor], detectors: Mapping[str, Callable[[torch.Tensor], torch.Tensor]],
                    device: torch.device | str = "cpu", num_batches: int | None = None,
                    progress: bool = True) -> tuple[Stats, int]:
    """Feature statistics of uint8 NCHW image batches under each metric's detector, summed over ranks."""
    accumulators = {metric: FeatureStats(detector.feature_dim, device) for metric, detector in detectors.items()}
    show = progress and distributed.is_main()
    for images in tqdm.tqdm(batches, total=num_batches, unit="batch", disable=not show):
        images = torch.as_tensor(images).to(device)
        if images.shape[1] == 1:
            images = images.expand(-1, 3, -1, -1)
        for metric, detector in detectors.items():
            accumulators[metric].add(detector(images))
    stats, num_images = {}, 0
    for metric, accumulator in accumulators.items():
        stats[metric], num_images = accumulator.finalize()
    return stats, num_images


def _stack_images(items: list[tuple[np.ndarray, object]]) -> torch.Tensor:
    """Collate dataset items (image, label) into a uint8 NCHW batch, dropping the labels."""
    return torch.from_numpy(np.stack([image for image, _ in items]))


def image_batches(dataset: torch.utils.data.Dataset, indices: np.ndarray, batch_size: int, num_workers: int = 2,
                  device: torch.device | str = "cpu") -> torch.utils.data.DataLoader:
    """A loader over this rank's share of dataset[indices], yielding uint8 NCHW batches."""
    batches = distributed.rank_batches(indices, batch_size, distributed.get_rank(), distributed.get_world_size())
    batches = [batch for batch in batches if batch]
    return torch.utils.data.DataLoader(dataset, batch_sampler=batches, num_workers=num_workers,
                                       collate_fn=_stack_images, pin_memory=torch.device(device).type == "cuda")


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """|mu1 - mu2|^2 + Tr(S1 + S2 - 2 sqrtm(S1 S2)), real part (Frechet distance of two Gaussians)."""
    mean_term = np.square(np.asarray(mu1, np.float64) - np.asarray(mu2, np.float64)).sum()
    root = scipy.linalg.sqrtm(np.dot(sigma1, sigma2))
    return float(np.real(mean_term + np.trace(sigma1 + sigma2 - 2 * root)))


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


def load_stats(path_or_url: str | os.PathLike) -> Stats:
    """Read statistics as {metric: {'mu', 'sigma'}} from our .npz, EDM's .npz (-> 'fid') or the release's .pkl."""
    source = str(path_or_url)
    path = files.cached_path(path_or_url)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise StatsError(f"cannot read statistics file {source}: {e.strerror or e}") from None
    if data[:4] == b"PK\x03\x04":  # NumPy .npz is a ZIP archive
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                arrays = {key: npz[key] for key in npz.files}
        except (ValueError, OSError) as e:
            raise StatsError(f"{source}: not a readable .npz of numeric arrays ({e})") from None
        if set(arrays) == {"mu", "sigma"}:  # EDM's reference files hold FID statistics only
            return _checked_stats({"fid": arrays}, source)
        nested: dict[str, dict[str, np.ndarray]] = {}
        for key, value in arrays.items():
            metric, _, field = key.rpartition("/")
            nested.setdefault(metric, {})[field] = value
        return _checked_stats(nested, source)
    try:
        raw = safe_pickle.restricted_load(io.BytesIO(data), _STATS_GLOBALS,
                                          "statistics pickles may hold only NumPy arrays and plain containers")
    except pickle.UnpicklingError as e:
        raise StatsError(f"{source}: {e}") from None
    except Exception as e:  # a malformed pickle can fail in many ways; none of them may escape as a traceback
        raise StatsError(f"{source}: not a statistics pickle ({e.__class__.__name__}: {e})") from None
    return _checked_stats(raw, source)


def save_stats(stats: Mapping[str, Mapping[str, np.ndarray]], path: str | os.PathLike) -> None:
    """Write statistics atomically: .npz (ours: '<metric>/mu', '<metric>/sigma') or .pkl (the release's format)."""
    path = Path(path)
    if path.suffix not in (".npz", ".pkl"):
        raise StatsError(f"{path}: statistics files end in .npz (ours) or .pkl (the release's format)")
    clean = {metric: {key: np.asarray(entry[key], dtype=np.float64) for key in ("mu", "sigma")}
             for metric, entry in stats.items()}
    with files.atomic_path(path) as tmp, open(tmp, "wb") as f:
        if path.suffix == ".npz":
            np.savez(f, **{f"{metric}/{key}": value for metric, entry in clean.items() for key, value in entry.items()})
        else:
            pickle.dump(clean, f)
