"""The metrics by name, each a number from the features of one detector: the Frechet distances (FID, FD_DINOv2)
from their statistics, and KID, precision, recall, density and coverage (edm2.eval.prdc) from the features kept
beside them, on Inception features or, with the suffix _dinov2, on DINOv2's."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from edm2.eval import prdc
from edm2.eval.metrics import Stats, frechet_distance

FEATURE_METRICS = ("kid", "precision", "recall", "density", "coverage")
# Metric -> the detector whose features it compares (edm2.eval.detectors.DETECTORS' keys, which also key Stats).
DETECTOR_OF = {"fid": "fid", "fd_dinov2": "fd_dinov2", **{name: "fid" for name in FEATURE_METRICS},
               **{f"{name}_dinov2": "fd_dinov2" for name in FEATURE_METRICS}}
METRICS = tuple(DETECTOR_OF)


def higher_is_better(metric: str) -> bool:
    """Whether a larger value is the better one (precision, recall, density, coverage); lower for the distances and
    the loss."""
    return metric.removesuffix("_dinov2") in ("precision", "recall", "density", "coverage")


def needs_features(metric: str) -> bool:
    """Whether a metric compares features themselves (kept in the statistics), not their mean and covariance."""
    return metric.removesuffix("_dinov2") in FEATURE_METRICS


def detectors_for(metrics: Sequence[str]) -> list[str]:
    """The detectors the metrics need, each once, in the order of the metrics."""
    return list(dict.fromkeys(DETECTOR_OF[metric] for metric in metrics if metric in DETECTOR_OF))


def metric_values(stats: Stats, reference: Stats, metrics: Sequence[str], device: torch.device | str = "cpu",
                  k: int = prdc.DEFAULT_K) -> dict[str, float]:
    """{metric: value} of generated statistics against the reference's, for the metrics of METRICS asked; precision,
    recall, density and coverage of one detector are computed together, once."""
    values: dict[str, float] = {}
    for metric in metrics:
        detector = DETECTOR_OF[metric]
        ours, ref = stats[detector], reference[detector]
        name = metric.removesuffix("_dinov2")
        if not needs_features(metric):
            values[metric] = frechet_distance(ours["mu"], ours["sigma"], ref["mu"], ref["sigma"])
        elif name == "kid":
            values[metric] = prdc.kernel_inception_distance(_tensor(ref, device), _tensor(ours, device))
        elif metric not in values:
            found = prdc.precision_recall_density_coverage(_tensor(ref, device), _tensor(ours, device), k)
            suffix = metric[len(name):]
            values.update({f"{key}{suffix}": value for key, value in found.items()})
    return {metric: values[metric] for metric in metrics}


def _tensor(entry: Mapping, device: torch.device | str) -> torch.Tensor:
    """An entry's kept features on device."""
    return torch.tensor(entry["features"], device=device)  # a copy: a file's arrays are read-only
