"""Feature statistics of image batches, summed across ranks, and the Frechet distance between two Gaussians."""

from __future__ import annotations

import itertools
from typing import Callable, Iterable, Mapping

import numpy as np
import torch
import tqdm

from edm2.errors import EDM2Error
from edm2.runtime import distributed

Stats = dict[str, dict[str, np.ndarray]]


class MetricsError(EDM2Error):
    """Statistics cannot be computed from what was given (too few images)."""


class FeatureStats:
    """Running float64 sum and sum of outer products of features; all-reduced across ranks at the end. With keep,
    also the first `keep` features themselves (float32), for the metrics of edm2.eval.prdc."""

    def __init__(self, dim: int, device: torch.device | str = "cpu", keep: int = 0):
        self.sum = torch.zeros([dim], dtype=torch.float64, device=device)
        self.outer = torch.zeros([dim, dim], dtype=torch.float64, device=device)
        self.count = torch.zeros([], dtype=torch.float64, device=device)
        self.keep, self.kept, self.num_kept = keep, [], 0  # this rank's batches of features, in its order

    def add(self, features: torch.Tensor) -> None:
        """Accumulate a batch of features [N, dim]."""
        f = features.to(device=self.sum.device, dtype=torch.float64)
        self.sum += f.sum(0)
        self.outer.addmm_(f.T, f)
        self.count += f.shape[0]
        if self.num_kept < self.keep:  # a rank's first `keep` suffice: the first `keep` of all ranks lie among them
            self.kept.append(features[:self.keep - self.num_kept].to("cpu", torch.float32).numpy())
            self.num_kept += self.kept[-1].shape[0]

    def kept_features(self) -> np.ndarray:
        """The first `keep` features of all ranks together, in the order of the whole stream [<= keep, dim]: batch j
        of the stream is batch j // world of rank j % world (edm2.runtime.distributed.rank_batches)."""
        per_rank = distributed.all_gather_object(self.kept)
        ordered = [batch for row in itertools.zip_longest(*per_rank) for batch in row if batch is not None]
        return np.concatenate(ordered)[:self.keep] if ordered else np.zeros([0, self.sum.shape[0]], np.float32)

    def finalize(self) -> tuple[dict[str, np.ndarray], int]:
        """({'mu', 'sigma'} and, with keep, 'features', number of features) over all ranks; every rank must call
        it."""
        total = distributed.all_reduce_sum(torch.cat([self.sum, self.outer.flatten(), self.count[None]]))
        dim = self.sum.shape[0]
        n = int(total[-1].item())
        if n < 2:
            raise MetricsError(f"need at least 2 images for statistics, got {n}")
        mu = total[:dim] / n
        # Unbiased covariance (divide by n - 1), as the release and StyleGAN3's metrics compute it.
        sigma = (total[dim:-1].reshape(dim, dim) - torch.outer(mu, mu) * n) / (n - 1)
        stats = {"mu": mu.cpu().numpy(), "sigma": sigma.cpu().numpy()}
        if self.keep:
            stats["features"] = self.kept_features()
        return stats, n


def calculate_stats(batches: Iterable[torch.Tensor], detectors: Mapping[str, Callable[[torch.Tensor], torch.Tensor]],
                    device: torch.device | str = "cpu", num_batches: int | None = None,
                    progress: bool = True, keep_features: int = 0) -> tuple[Stats, int]:
    """Feature statistics of uint8 NCHW image batches under each metric's detector, summed over ranks; with
    keep_features, each also holds the first that many features of the stream ('features')."""
    accumulators = {metric: FeatureStats(detector.feature_dim, device, keep_features)
                    for metric, detector in detectors.items()}
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


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """|mu1 - mu2|^2 + Tr(S1 + S2 - 2 sqrtm(S1 S2)), real part (Frechet distance of two Gaussians)."""
    import scipy.linalg  # here, not at the top: 0.4 s of every command's start that only FID needs

    mean_term = np.square(np.asarray(mu1, np.float64) - np.asarray(mu2, np.float64)).sum()
    root = scipy.linalg.sqrtm(np.dot(sigma1, sigma2))
    return float(np.real(mean_term + np.trace(sigma1 + sigma2 - 2 * root)))
