"""Statistics files: ours (.npz), the release's .pkl, EDM's .npz; pickles carrying code; datasets given instead;
headers declaring more than a file holds; non-finite statistics."""

import io
import os
import pickle
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from edm2.eval import stats_files
from tests.helpers import random_covariance, run_within_memory


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


def npz_with(path, members: dict) -> Path:
    """An .npz whose members are given as raw .npy bytes (headers written by hand) or arrays."""
    with zipfile.ZipFile(path, "w") as archive:
        for name, member in members.items():
            if isinstance(member, np.ndarray):
                buffer = io.BytesIO()
                np.save(buffer, member)
                member = buffer.getvalue()
            archive.writestr(name + ".npy", member)
    return path


def npy_declaring(shape, data=b"\0" * 64, descr="<f8") -> bytes:
    """.npy bytes whose header declares `shape` of `descr`, followed by `data` (whatever its length)."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue() + data


@pytest.mark.bad_input
@pytest.mark.parametrize("shape", [(10**6, 10**6), (4096, 4096)], ids=["beyond the bound", "beyond the file"])
def test_npz_headers_declaring_more_than_the_file_holds_are_refused_within_a_memory_bound(tmp_path, shape):
    # (1e6, 1e6) float64 is 8 TB; (4096, 4096) is 128 MiB, within the width bound but not in a file of a few
    # hundred bytes. Either is refused from its header, within 64 MiB more address space than the process uses.
    path = npz_with(tmp_path / "ref.npz", {"fid/mu": np.zeros(8), "fid/sigma": npy_declaring(shape)})
    done = run_within_memory("from edm2.eval import stats_files", "stats_files.load_stats(sys.argv[1])", 64 << 20,
                             str(path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"refused: {path}: fid/sigma.npy declares ") and str(shape[0]) in done.stdout


@pytest.mark.bad_input
@pytest.mark.parametrize("member, message", [
    (npy_declaring((3,), descr="|O"), "not numbers"),
    (npy_declaring((), b"\0" * 8), "declares shape ()"),
    (npy_declaring((2, 2, 2)), "declares shape (2, 2, 2)"),
    (npy_declaring((8,), b"\0" * 60), "declares 64 bytes of data ((8,), float64) but holds 60"),
    (b"\x93NUMPY\x09\x00junk", "not a .npy array"),
], ids=["objects", "scalar", "three axes", "short data", "unknown version"])
def test_malformed_npz_members_are_refused(tmp_path, member, message):
    path = npz_with(tmp_path / "ref.npz", {"fid/mu": member, "fid/sigma": np.eye(8)})
    with pytest.raises(stats_files.StatsError, match=re.escape(message)) as info:
        stats_files.load_stats(path)
    assert str(info.value).startswith(f"{path}: fid/mu.npy") and "\n" not in str(info.value)


def test_fortran_ordered_and_narrower_numbers_are_read(tmp_path):
    # np.save keeps a Fortran-ordered array's order in the header; integers and float32 are numbers too.
    rng = np.random.default_rng(9)
    sigma = np.asfortranarray(random_covariance(rng, 5))
    mu = rng.integers(-5, 5, 5).astype(np.int32)
    stats = stats_files.load_stats(npz_with(tmp_path / "ref.npz", {"fid/mu": mu, "fid/sigma": sigma}))
    assert_same_stats(stats, {"fid": {"mu": mu.astype(np.float64), "sigma": sigma}})


@pytest.mark.bad_input
@pytest.mark.parametrize("where, bad", [("mu", np.nan), ("sigma", np.inf), ("sigma", -np.inf)])
@pytest.mark.parametrize("kind", ["ours", "release pkl", "EDM npz"])
def test_non_finite_statistics_are_refused(tmp_path, where, bad, kind):
    stats = make_stats(np.random.default_rng(10))
    stats["fid"][where].flat[3] = bad
    if kind == "ours":
        path = tmp_path / "ref.npz"
        stats_files.save_stats(path, stats)
    elif kind == "release pkl":
        path = tmp_path / "ref.pkl"
        with open(path, "wb") as f:
            pickle.dump({"num_images": 50000, **stats}, f)
    else:
        path = tmp_path / "edm.npz"
        np.savez(path, **stats["fid"])
    with pytest.raises(stats_files.StatsError, match=re.escape(f"{path}: metric 'fid' has a mu or sigma that is "
                                                               "not finite")):
        stats_files.load_stats(path)


def test_statistics_wider_than_the_bound_are_refused(tmp_path):
    # A pickle builds its arrays before any check can see them (edm2.formats.safe_pickle bounds that); the width bound
    # still keeps such statistics from reaching the Frechet distance.
    width = stats_files.MAX_FEATURES + 1
    with open(tmp_path / "wide.pkl", "wb") as f:
        pickle.dump({"fid": {"mu": np.zeros(width), "sigma": np.zeros((1, 1))}}, f)
    with pytest.raises(stats_files.StatsError, match=f"mu \\({width},\\) and sigma \\(1, 1\\)"):
        stats_files.load_stats(tmp_path / "wide.pkl")
