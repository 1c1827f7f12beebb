"""Statistics files: ours (.npz), the release's .pkl, EDM's .npz; pickles carrying code; datasets given instead."""

import os
import pickle
import zipfile

import numpy as np
import pytest

from edm2 import stats_files
from tests.helpers import random_covariance


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
    stats_files.save_stats(path, stats)
    assert_same_stats(stats_files.load_stats(path), stats)
    assert_same_stats(stats_files.load_stats(path.as_uri()), stats)
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_save_stats_refuses_unknown_suffix_and_writes_nothing(tmp_path):
    with pytest.raises(stats_files.StatsError, match="npz"):
        stats_files.save_stats(tmp_path / "ref.json", make_stats(np.random.default_rng(5)))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_release_pickle_is_read(tmp_path, protocol):
    stats = make_stats(np.random.default_rng(6))
    # The release pickles a plain dict: the image count beside one {'mu', 'sigma'} dict per metric.
    with open(tmp_path / "img512.pkl", "wb") as f:
        pickle.dump({"num_images": 1281167, **stats}, f, protocol=protocol)
    assert_same_stats(stats_files.load_stats(tmp_path / "img512.pkl"), stats)


def test_edm_npz_is_read_as_fid(tmp_path):
    rng = np.random.default_rng(7)
    mu, sigma = rng.standard_normal(4), random_covariance(rng, 4)
    np.savez(tmp_path / "imagenet-64x64.npz", mu=mu, sigma=sigma)
    assert_same_stats(stats_files.load_stats(tmp_path / "imagenet-64x64.npz"), {"fid": {"mu": mu, "sigma": sigma}})


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
    with pytest.raises(stats_files.StatsError, match=r"evil\.pkl.*refusing to load '(posix|os|builtins)\.(system|eval)'"):
        stats_files.load_stats(tmp_path / "evil.pkl")
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
    with pytest.raises(stats_files.StatsError, match=message):
        stats_files.load_stats(tmp_path / "bad.pkl")


def test_missing_or_garbage_stats_files_are_refused(tmp_path):
    with pytest.raises(stats_files.StatsError, match="cannot read"):
        stats_files.load_stats(tmp_path / "absent.npz")
    (tmp_path / "garbage.pkl").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(stats_files.StatsError, match="garbage.pkl"):
        stats_files.load_stats(tmp_path / "garbage.pkl")


def test_a_folder_or_dataset_zip_is_not_statistics(tmp_path):
    (tmp_path / "images").mkdir()
    with pytest.raises(stats_files.NotStatisticsError, match="is a folder"):
        stats_files.load_stats(tmp_path / "images")
    with zipfile.ZipFile(tmp_path / "img512.zip", "w") as archive:  # as dataset_tool.py writes a dataset
        archive.writestr("00000/img00000000.png", b"\x89PNG")
        archive.writestr("dataset.json", '{"labels": null}')
    with pytest.raises(stats_files.NotStatisticsError, match="img512.zip is a ZIP of images"):
        stats_files.load_stats(tmp_path / "img512.zip")
