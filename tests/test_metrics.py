"""Frechet distance against closed forms, float64 feature statistics against NumPy."""

import numpy as np
import pytest
import torch

from edm2.eval import metrics
from tests.helpers import random_covariance

# Unit round-off of float64: a sum of n terms computed in any order is off by at most about n * U64 * sum|term|.
U64 = np.finfo(np.float64).eps / 2


def psd_sqrt(s):
    values, vectors = np.linalg.eigh(s)
    return vectors @ np.diag(np.sqrt(np.clip(values, 0, None))) @ vectors.T


def test_frechet_distance_of_commuting_gaussians_equals_closed_form():
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((6, 6)))
    a, b = rng.uniform(0.1, 3, 6), rng.uniform(0.1, 3, 6)
    mu1, mu2 = rng.standard_normal(6), rng.standard_normal(6)
    # Shared eigenvectors: Tr sqrt(S1 S2) = sum sqrt(a_i b_i).
    expected = np.sum((mu1 - mu2) ** 2) + np.sum(a + b - 2 * np.sqrt(a * b))
    got = metrics.frechet_distance(mu1, q @ np.diag(a) @ q.T, mu2, q @ np.diag(b) @ q.T)
    # Eigenvalues in [0.01, 9] (condition number < 1000): sqrtm's float64 error is about 6 * U64 * 1000 relative.
    assert got == pytest.approx(expected, rel=1e-10)
    # One dimension: (m1 - m2)^2 + (s1 - s2)^2.
    assert metrics.frechet_distance(np.array([1.0]), np.array([[4.0]]), np.array([-2.0]), np.array([[9.0]])) == \
        pytest.approx(9 + 1, rel=1e-12)  # a few float64 operations on small integers


def test_frechet_distance_of_general_gaussians_equals_symmetric_form():
    rng = np.random.default_rng(1)
    s1, s2 = random_covariance(rng, 20), random_covariance(rng, 20)
    mu1, mu2 = rng.standard_normal(20), rng.standard_normal(20)
    # Tr sqrt(S1 S2) = Tr sqrt(S1^1/2 S2 S1^1/2), a symmetric PSD root computed by eigendecomposition.
    root1 = psd_sqrt(s1)
    expected = np.sum((mu1 - mu2) ** 2) + np.trace(s1 + s2) - 2 * np.trace(psd_sqrt(root1 @ s2 @ root1))
    # Both roots are backward stable (error ~ 20 * U64 * |S1 S2|, eigenvalues of full-rank 20x20 Wishart
    # matrices >= 1e-3): the traces agree to ~1e-11 relative; 1e-9 leaves a factor of 100.
    assert metrics.frechet_distance(mu1, s1, mu2, s2) == pytest.approx(expected, rel=1e-9)


def test_frechet_distance_of_stats_with_itself_is_zero():
    rng = np.random.default_rng(2)
    features = rng.standard_normal((500, 64)) @ rng.standard_normal((64, 64))
    mu, sigma = features.mean(0), np.cov(features, rowvar=False)
    # Full rank: Tr sqrt(S S) = Tr S up to sqrtm's backward error 64 * U64 * |S| per eigenvalue.
    assert abs(metrics.frechet_distance(mu, sigma, mu, sigma)) < 1e-9 * np.trace(sigma)


def test_feature_stats_equal_numpy_mean_and_unbiased_cov():
    rng = np.random.default_rng(3)
    # Detectors give float32 features with large means; a float32 accumulator would miss these bounds by far.
    features = (rng.standard_normal((103, 7)) * rng.uniform(0.1, 5, 7) + rng.uniform(-20, 20, 7)).astype(np.float32)
    acc = metrics.FeatureStats(7)
    for chunk in np.array_split(features, [10, 11, 60]):  # uneven batches, including one of size 1
        acc.add(torch.from_numpy(chunk))
    stats, n = acc.finalize()
    features = features.astype(np.float64)  # exact: every float32 is a float64
    assert n == 103
    # Both sides sum n float64 terms in some order: each is off by <= n * U64 * sum|term|.
    mean_bound = 2 * n * U64 * np.abs(features).max()
    np.testing.assert_allclose(stats["mu"], features.mean(0), rtol=0, atol=mean_bound)
    # Sums of f_j f_k: sum|f_j f_k| <= n * M with M = max_j mean(f_j^2) (Cauchy-Schwarz), divided by n - 1;
    # the n mu mu^T term adds a few U64 * n * M more. Two computations, each within (n + 3) n / (n - 1) U64 M.
    second_moment = (features ** 2).mean(0).max()
    cov_bound = 2 * (n + 3) * n / (n - 1) * U64 * second_moment
    np.testing.assert_allclose(stats["sigma"], np.cov(features, rowvar=False, ddof=1), rtol=0, atol=cov_bound)
    assert stats["mu"].dtype == stats["sigma"].dtype == np.float64


def test_feature_stats_need_two_samples():
    acc = metrics.FeatureStats(3)
    acc.add(torch.ones(1, 3))
    with pytest.raises(metrics.MetricsError, match="at least 2"):
        acc.finalize()
