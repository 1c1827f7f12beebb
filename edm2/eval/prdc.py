"""Metrics of two sets of detector features beyond the Frechet distance: improved precision and recall
(Kynkaanniemi et al. 2019, k-NN manifolds), density and coverage (Naeem et al. 2020), and the kernel inception
distance (Binkowski et al. 2018, unbiased MMD^2 with the cubic polynomial kernel).

Distances are Euclidean, computed in float64 in row blocks, so memory stays at a block of one distance matrix
however many features there are. A point lies in a k-NN ball when its distance is at most the ball's radius, the
distance from the ball's centre to its k-th nearest neighbour in its own set (itself not counted), for precision
and recall (Kynkaanniemi et al.'s Eq. 1); for density and coverage when it is nearer than the radius, as Naeem et
al.'s own code counts it (so a set against itself has density exactly 1: each point lies in its own ball and in
those of the neighbours nearer than their k-th). Distances are differences squared and summed, not the faster
|a|^2 + |b|^2 - 2ab, so d(a, b) and d(b, a) are the same number and a radius compares equal to the distance it
came from.
"""

from __future__ import annotations

from typing import Iterator

import torch

DEFAULT_K = 3  # Kynkaanniemi et al. 2019 and Naeem et al. 2020 both report k = 3 for their recommended settings
BLOCK_ELEMENTS = 1 << 24  # float64 distances per block: 128 MiB


def _as_float64(features: torch.Tensor) -> torch.Tensor:
    """Features [N, D] as float64 (on their device)."""
    return torch.as_tensor(features).to(torch.float64)


def _distance_blocks(a: torch.Tensor, b: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
    """(rows, |a[rows] - b|) for blocks of rows of a, each at most BLOCK_ELEMENTS distances."""
    rows = max(1, BLOCK_ELEMENTS // max(b.shape[0], 1))
    for start in range(0, a.shape[0], rows):
        block = slice(start, start + rows)
        yield block, torch.cdist(a[block], b, compute_mode="donot_use_mm_for_euclid_dist")


def knn_radii(features: torch.Tensor, k: int = DEFAULT_K) -> torch.Tensor:
    """Distance of each feature to its k-th nearest neighbour among the others of its set [N]."""
    x = _as_float64(features)
    if not 1 <= k < x.shape[0]:
        raise ValueError(f"k = {k} needs more than k features; got {x.shape[0]}")
    radii = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    for block, distances in _distance_blocks(x, x):
        radii[block] = distances.kthvalue(k + 1, dim=1).values  # the (k+1)-th smallest: the point itself is 0
    return radii


def _in_balls(points: torch.Tensor, centres: torch.Tensor, radii: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per point: in any ball [P] bool, the distance at most the radius; per point: the number of balls it lies
    in nearer than the radius [P]) for balls B(centres, radii)."""
    inside_any = torch.empty(points.shape[0], dtype=torch.bool, device=points.device)
    count = torch.empty(points.shape[0], dtype=torch.float64, device=points.device)
    for block, distances in _distance_blocks(points, centres):
        inside_any[block] = (distances <= radii[None, :]).any(dim=1)
        count[block] = (distances < radii[None, :]).sum(dim=1, dtype=torch.float64)
    return inside_any, count


def precision_recall_density_coverage(real: torch.Tensor, fake: torch.Tensor,
                                      k: int = DEFAULT_K) -> dict[str, float]:
    """{'precision', 'recall', 'density', 'coverage'} of generated features `fake` against `real` ones [N, D].

    precision: the share of fake points inside the real manifold (the union of the real k-NN balls); recall: the
    share of real points inside the fake manifold (Kynkaanniemi et al. 2019). density: the mean number of real balls
    a fake point lies in, divided by k; coverage: the share of real balls holding at least one fake point (Naeem et
    al. 2020).
    """
    real = _as_float64(real)
    fake = _as_float64(fake).to(real.device)
    real_radii, fake_radii = knn_radii(real, k), knn_radii(fake, k)
    fake_in_real, balls_per_fake = _in_balls(fake, real, real_radii)
    real_in_fake, _ = _in_balls(real, fake, fake_radii)
    # Coverage: a real ball is covered when its nearest fake point lies within its radius.
    nearest_fake = torch.cat([distances.min(dim=1).values for _, distances in _distance_blocks(real, fake)])
    return dict(precision=float(fake_in_real.double().mean()), recall=float(real_in_fake.double().mean()),
                density=float(balls_per_fake.sum() / (k * fake.shape[0])),
                coverage=float((nearest_fake < real_radii).double().mean()))


def kernel_inception_distance(real: torch.Tensor, fake: torch.Tensor) -> float:
    """The unbiased estimate of MMD^2 between the feature sets [M, D] and [N, D] with the kernel
    k(x, y) = (x.y / D + 1)^3 (Binkowski et al. 2018, Eq. 3 with their polynomial kernel); 0 in expectation for
    samples of one distribution, so a small negative value is possible."""
    x = _as_float64(real)
    y = _as_float64(fake).to(x.device)
    m, n, dim = x.shape[0], y.shape[0], x.shape[1]
    if min(m, n) < 2:
        raise ValueError(f"KID needs at least 2 features on each side; got {m} and {n}")

    def kernel_sum(a: torch.Tensor, b: torch.Tensor, same: bool) -> torch.Tensor:
        """Sum of k(a_i, b_j) over all pairs, without i = j when a and b are one set."""
        total = torch.zeros([], dtype=torch.float64, device=a.device)
        rows = max(1, BLOCK_ELEMENTS // max(b.shape[0], 1))
        for start in range(0, a.shape[0], rows):
            values = (a[start:start + rows] @ b.T / dim + 1) ** 3
            total += values.sum()
            if same:
                total -= values.diagonal(offset=start).sum()
        return total

    return float(kernel_sum(x, x, True) / (m * (m - 1)) + kernel_sum(y, y, True) / (n * (n - 1))
                 - 2 * kernel_sum(x, y, False) / (m * n))
