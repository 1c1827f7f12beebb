"""Precision, recall, density, coverage and KID (edm2.eval.prdc) against direct O(n^2) computations written here,
against prdc and torchmetrics, and on identical sets."""

import itertools

import numpy as np
import pytest
import torch

from edm2.eval import prdc


def features(n, dim=6, shift=0.0, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).normal(shift, 1.0, size=(n, dim)))


def direct(real, fake, k):
    """The definitions, pair by pair in float64 Python loops."""
    real, fake = real.numpy(), fake.numpy()

    def dist(a, b):
        return float(np.sqrt(((a - b) ** 2).sum()))

    def radii(x):
        return [sorted(dist(p, q) for j, q in enumerate(x) if j != i)[k - 1] for i, p in enumerate(x)]

    r_real, r_fake = radii(real), radii(fake)
    precision = np.mean([any(dist(f, r) <= rad for r, rad in zip(real, r_real)) for f in fake])
    recall = np.mean([any(dist(r, f) <= rad for f, rad in zip(fake, r_fake)) for r in real])
    # Density and coverage count a point in a ball when it is nearer than the radius (Naeem et al.'s code).
    density = sum(dist(f, r) < rad for f in fake for r, rad in zip(real, r_real)) / (k * len(fake))
    coverage = np.mean([any(dist(r, f) < rad for f in fake) for r, rad in zip(real, r_real)])
    return dict(precision=precision, recall=recall, density=density, coverage=coverage)


def unbiased_mmd2(x, y):
    """Binkowski et al.'s unbiased MMD^2, pair by pair, kernel (x.y / d + 1)^3."""
    x, y = x.numpy(), y.numpy()
    d = x.shape[1]

    def k(a, b):
        return (a @ b / d + 1) ** 3

    m, n = len(x), len(y)
    xx = sum(k(x[i], x[j]) for i, j in itertools.permutations(range(m), 2)) / (m * (m - 1))
    yy = sum(k(y[i], y[j]) for i, j in itertools.permutations(range(n), 2)) / (n * (n - 1))
    xy = sum(k(a, b) for a in x for b in y) / (m * n)
    return xx + yy - 2 * xy


@pytest.mark.parametrize("k", [1, 3, 5])
def test_prdc_equals_the_direct_definitions(k):
    real, fake = features(40), features(30, shift=0.4, seed=1)
    got = prdc.precision_recall_density_coverage(real, fake, k)
    want = direct(real, fake, k)
    # Each value is a count over pairs divided by an integer; the distances of continuous data tie with probability 0.
    assert got == pytest.approx(want, abs=1e-12)


def test_prdc_equals_the_prdc_package():
    package = pytest.importorskip("prdc")
    real, fake = features(60, dim=8), features(50, dim=8, shift=0.3, seed=2)
    want = package.compute_prdc(real.numpy(), fake.numpy(), nearest_k=3)
    got = prdc.precision_recall_density_coverage(real, fake, 3)
    # prdc counts a point inside a ball with '<' where precision and recall (Kynkaanniemi et al. Eq. 1) use '<=':
    # equal without ties, which continuous data has with probability 0.
    assert got == pytest.approx({key: float(value) for key, value in want.items()}, abs=1e-12)


def test_blocks_change_nothing(monkeypatch):
    real, fake = features(35), features(33, shift=0.2, seed=3)
    whole = prdc.precision_recall_density_coverage(real, fake), prdc.kernel_inception_distance(real, fake)
    monkeypatch.setattr(prdc, "BLOCK_ELEMENTS", 7)  # blocks of one row
    blocked = prdc.precision_recall_density_coverage(real, fake), prdc.kernel_inception_distance(real, fake)
    # One approx per value: pytest 9.2's approx no longer compares a tuple holding a dict.
    assert blocked[0] == pytest.approx(whole[0], abs=1e-12) and blocked[1] == pytest.approx(whole[1], abs=1e-12)


def test_identical_sets_give_the_known_values():
    x = features(50)
    got = prdc.precision_recall_density_coverage(x, x.clone(), 3)
    assert got["precision"] == got["recall"] == got["coverage"] == 1
    # Density of a set against itself: each ball holds its centre and the k - 1 neighbours nearer than its k-th,
    # so N k points counted in balls, over k N, is exactly 1.
    assert got["density"] == pytest.approx(1, abs=1e-12)
    assert direct(x, x, 3) == pytest.approx(got, abs=1e-12)


def test_kid_equals_the_unbiased_mmd_formula():
    x, y = features(25, dim=5), features(20, dim=5, shift=0.5, seed=4)
    want = unbiased_mmd2(x, y)
    # float64 sums of ~m^2 kernel values of size ~1: round-off ~m^2 eps64 relative.
    assert prdc.kernel_inception_distance(x, y) == pytest.approx(want, rel=1e-10, abs=1e-12)


def test_kid_of_one_distribution_is_zero_within_its_estimators_spread():
    x, y = features(400, dim=4, seed=5), features(400, dim=4, seed=6)
    # Unbiased: E = 0; its standard deviation for n samples is O(1/n) times the kernel's scale (values ~1 here).
    assert abs(prdc.kernel_inception_distance(x, y)) < 0.05
    assert prdc.kernel_inception_distance(x, features(400, dim=4, shift=1.0, seed=7)) > 0.5


@pytest.mark.filterwarnings("ignore:Metric `Kernel Inception Distance` will save")
def test_kid_equals_torchmetrics():
    kid = pytest.importorskip("torchmetrics.image.kid")
    x, y = features(30, dim=4), features(30, dim=4, shift=0.3, seed=8)

    class Identity(torch.nn.Module):
        def forward(self, features):
            return features

    metric = kid.KernelInceptionDistance(feature=Identity(), subsets=3, subset_size=30, normalize=True)
    metric.update(x, real=True)
    metric.update(y, real=False)
    mean, std = metric.compute()
    # With subsets as large as the sets, every subset is all of them: each estimate is the full unbiased MMD^2.
    assert float(mean) == pytest.approx(prdc.kernel_inception_distance(x, y), rel=1e-9)
    assert float(std) < 1e-9
