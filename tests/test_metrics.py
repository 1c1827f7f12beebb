"""Frechet distance against closed forms, float64 statistics against NumPy, statistics files and safe pickles."""

import os
import pickle

import numpy as np
import pytest
import torch

from edm2 import metrics


def random_covariance(rng, dim):
    a = rng.standard_normal((dim, dim + 3))
    return a @ a.T / dim


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
    assert got == pytest.approx(expected, rel=1e-10)
    # One dimension: (m1 - m2)^2 + (s1 - s2)^2.
    assert metrics.frechet_distance(np.array([1.0]), np.array([[4.0]]), np.array([-2.0]), np.array([[9.0]])) == \
        pytest.approx(9 + 1, rel=1e-12)


def test_frechet_distance_of_general_gaussians_equals_symmetric_form():
    rng = np.random.default_rng(1)
    s1, s2 = random_covariance(rng, 20), random_covariance(rng, 20)
    mu1, mu2 = rng.standard_normal(20), rng.standard_normal(20)
    # Tr sqrt(S1 S2) = Tr sqrt(S1^1/2 S2 S1^1/2), a symmetric PSD root computed by eigendecomposition.
    root1 = psd_sqrt(s1)
    expected = np.sum((mu1 - mu2) ** 2) + np.trace(s1 + s2) - 2 * np.trace(psd_sqrt(root1 @ s2 @ root1))
    assert metrics.frechet_distance(mu1, s1, mu2, s2) == pytest.approx(expected, rel=1e-9)


def test_frechet_distance_of_stats_with_itself_is_zero():
    rng = np.random.default_rng(2)
    features = rng.standard_normal((500, 64)) @ rng.standard_normal((64, 64))
    mu, sigma = features.mean(0), np.cov(features, rowvar=False)
    assert abs(metrics.frechet_distance(mu, sigma, mu, sigma)) < 1e-9 * np.trace(sigma)


def test_feature_stats_equal_numpy_mean_and_unbiased_cov():
    rng = np.random.default_rng(3)
    # Detectors give float32 features with large means; a float32 accumulator would miss 1e-12 by far.
    features = (rng.standard_normal((103, 7)) * rng.uniform(0.1, 5, 7) + rng.uniform(-20, 20, 7)).astype(np.float32)
    acc = metrics.FeatureStats(7)
    for chunk in np.array_split(features, [10, 11, 60]):  # uneven batches, including one of size 1
        acc.add(torch.from_numpy(chunk))
    stats, n = acc.finalize()
    features = features.astype(np.float64)
    assert n == 103
    np.testing.assert_allclose(stats["mu"], features.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(stats["sigma"], np.cov(features, rowvar=False, ddof=1), rtol=1e-10, atol=1e-11)
    assert stats["mu"].dtype == stats["sigma"].dtype == np.float64


def test_feature_stats_need_two_samples():
    acc = metrics.FeatureStats(3)
    acc.add(torch.ones(1, 3))
    with pytest.raises(ValueError, match="at least 2"):
        acc.finalize()


def make_stats(rng, dims=(("fid", 5), ("fd_dinov2", 3))):
    return {name: {"mu": rng.standard_normal(d), "sigma": random_covariance(rng, d)} for name, d in dims}


def assert_same_stats(a, b):
    assert sorted(a) == sorted(b)
    for metric in a:
        np.testing.assert_array_equal(a[metric]["mu"], b[metric]["mu"])
        np.testing.assert_array_equal(a[metric]["sigma"], b[metric]["sigma"])


@pytest.mark.parametrize("suffix", [".npz", ".pkl"])
def test_save_and_load_stats_round_trip(tmp_path, suffix):
    stats = make_stats(np.random.default_rng(4))
    path = tmp_path / f"sub/ref{suffix}"
    metrics.save_stats(stats, path)
    assert_same_stats(metrics.load_stats(path), stats)
    assert_same_stats(metrics.load_stats(path.as_uri()), stats)
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_save_stats_refuses_unknown_suffix_and_writes_nothing(tmp_path):
    with pytest.raises(metrics.StatsError, match="npz"):
        metrics.save_stats(make_stats(np.random.default_rng(5)), tmp_path / "ref.json")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_release_pickle_is_read(tmp_path, protocol):
    stats = make_stats(np.random.default_rng(6))
    # The release pickles a plain dict: the image count beside one {'mu', 'sigma'} dict per metric.
    with open(tmp_path / "img512.pkl", "wb") as f:
        pickle.dump({"num_images": 1281167, **stats}, f, protocol=protocol)
    assert_same_stats(metrics.load_stats(tmp_path / "img512.pkl"), stats)


def test_edm_npz_is_read_as_fid(tmp_path):
    rng = np.random.default_rng(7)
    mu, sigma = rng.standard_normal(4), random_covariance(rng, 4)
    np.savez(tmp_path / "imagenet-64x64.npz", mu=mu, sigma=sigma)
    assert_same_stats(metrics.load_stats(tmp_path / "imagenet-64x64.npz"), {"fid": {"mu": mu, "sigma": sigma}})


class _Payload:
    def __init__(self, call, arg):
        self.call, self.arg = call, arg

    def __reduce__(self):
        return self.call, (self.arg,)


@pytest.mark.parametrize("kind", ["os.system", "builtins.eval"])
def test_pickle_carrying_code_is_refused_and_nothing_runs(tmp_path, kind):
    marker = tmp_path / "ran"
    payload = _Payload(os.system, f"touch {marker}") if kind == "os.system" else \
        _Payload(eval, f"open({str(marker)!r}, 'w')")
    stats = make_stats(np.random.default_rng(8))
    stats["fid"]["mu"] = payload
    with open(tmp_path / "evil.pkl", "wb") as f:
        pickle.dump(stats, f)
    with pytest.raises(metrics.StatsError, match=r"evil\.pkl.*refusing to load '(posix|os|builtins)\.(system|eval)'"):
        metrics.load_stats(tmp_path / "evil.pkl")
    assert not marker.exists()


@pytest.mark.parametrize("content, message", [
    ({"fid": {"mu": np.zeros(3)}}, "lacks"),
    ({"fid": {"mu": np.zeros(3), "sigma": np.zeros((2, 2))}}, "expected"),
    ({"num_images": 5}, "no metric"),
    ([1, 2], "expected a dict"),
])
def test_malformed_stats_are_refused(tmp_path, content, message):
    with open(tmp_path / "bad.pkl", "wb") as f:
        pickle.dump(content, f)
    with pytest.raises(metrics.StatsError, match=message):
        metrics.load_stats(tmp_path / "bad.pkl")


def test_missing_or_garbage_stats_files_are_refused(tmp_path):
    with pytest.raises(metrics.StatsError, match="cannot read"):
        metrics.load_stats(tmp_path / "absent.npz")
    (tmp_path / "garbage.pkl").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(metrics.StatsError, match="garbage.pkl"):
        metrics.load_stats(tmp_path / "garbage.pkl")
