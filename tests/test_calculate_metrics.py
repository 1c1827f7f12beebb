"""calculate_metrics.py end to end with tiny detectors on images the test writes; torchrun; bad input."""

import json
import pickle
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
import torch
from click.testing import CliRunner

import calculate_metrics
from edm2 import detectors, metrics
from edm2.encoders import StandardRGBEncoder
from edm2.generation import generate_images
from edm2.snapshot import load_network, save_network
from tests.helpers import (REPO, TinyInceptionStandIn, assert_one_error_line, free_port, random_dinov2_state_dict,
                           randomized, tiny_precond)

# One 64-channel head keeps the 64x64 covariances cheap for scipy's sqrtm.
DINOV2_CONFIG = dict(width=64, depth=1, patch=14, grid=5, mlp=128)


def write_images(folder, num, seed, brightness):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for i in range(num):
        pixels = np.clip(rng.normal(brightness, 60, size=(16, 16, 3)), 0, 255).astype(np.uint8)
        PIL.Image.fromarray(pixels).save(folder / f"img{i:04d}.png")
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(TinyInceptionStandIn()), root / "inception.pt")
    torch.save(random_dinov2_state_dict(**DINOV2_CONFIG), root / "dinov2.pth")
    return dict(
        root=root,
        a=write_images(root / "a", 12, seed=1, brightness=100),
        b=write_images(root / "b", 10, seed=2, brightness=160),
        weights=["--inception", str(root / "inception.pt"), "--dinov2", str(root / "dinov2.pth")],
    )


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path / "cache"))


def direct_stats(setup, folder, indices=None):
    """Statistics computed without the command line: PIL images, detectors called once, NumPy mean/cov."""
    paths = sorted(folder.glob("*.png"))
    if indices is not None:
        paths = [paths[i] for i in indices]
    images = torch.from_numpy(np.stack([np.array(PIL.Image.open(p)).transpose(2, 0, 1) for p in paths]))
    stats = {}
    for metric, path in (("fid", "inception.pt"), ("fd_dinov2", "dinov2.pth")):
        features = detectors.load_detector(metric, setup["root"] / path)(images).double().numpy()
        stats[metric] = {"mu": features.mean(0), "sigma": np.cov(features, rowvar=False)}
    return stats


def run(*args):
    return CliRunner().invoke(calculate_metrics.main, [str(a) for a in args])


def results_of(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.splitlines()[-1])


def expected_distances(stats, ref):
    return {m: metrics.frechet_distance(stats[m]["mu"], stats[m]["sigma"], ref[m]["mu"], ref[m]["sigma"]) for m in ref}


def assert_stats_close(got, expected, rtol=1e-9):
    assert sorted(got) == sorted(expected)
    for metric in expected:
        for key in ("mu", "sigma"):
            np.testing.assert_allclose(got[metric][key], expected[metric][key], rtol=rtol, atol=1e-9)


def test_help_shows_examples():
    result = run("--help")
    assert result.exit_code == 0 and "calculate_metrics.py calc --images=out" in result.output


def test_ref_and_calc_end_to_end(setup, tmp_path):
    ref_a = direct_stats(setup, setup["a"])
    result = run("ref", "--data", setup["a"], "--dest", tmp_path / "a.npz", "--batch", 5, "--workers", 0,
                 *setup["weights"])
    assert results_of(result)["num_images"] == 12
    assert_stats_close(metrics.load_stats(tmp_path / "a.npz"), ref_a)

    result = run("calc", "--images", setup["b"], "--ref", tmp_path / "a.npz", "--num", 10, "--workers", 1,
                 *setup["weights"])
    out = results_of(result)
    assert out["num_images"] == 10
    expected = expected_distances(direct_stats(setup, setup["b"]), ref_a)
    assert out["results"] == pytest.approx(expected, rel=1e-7)
    assert min(expected.values()) > 1e-3
    assert result.stdout.splitlines()[-2].startswith(f"fid {expected['fid']:.4f}  fd_dinov2 ")

    # The same images against their own statistics: distance 0 up to round-off (sqrtm of a rank-11 covariance).
    out = results_of(run("calc", "--images", setup["a"], "--ref", tmp_path / "a.npz", "--num", 12, *setup["weights"]))
    assert all(abs(v) < 1e-4 for v in out["results"].values()), out


def test_calc_takes_a_seeded_random_subset(setup, tmp_path):
    ref_b = direct_stats(setup, setup["b"])
    metrics.save_stats(ref_b, tmp_path / "b.pkl")  # the release's format works as --ref too
    outs = [results_of(run("calc", "--images", setup["a"], "--ref", tmp_path / "b.pkl", "--num", 5, "--seed", seed,
                           "--batch", 2, "--workers", 0, *setup["weights"])) for seed in (7, 7, 8)]
    assert outs[0] == outs[1] and outs[0]["results"] != outs[2]["results"]
    subset = np.random.RandomState(7).permutation(12)[:5]
    expected = expected_distances(direct_stats(setup, setup["a"], subset), ref_b)
    assert outs[0]["results"] == pytest.approx(expected, rel=1e-7)


def test_two_processes_give_the_statistics_of_one(setup, tmp_path):
    one = tmp_path / "one.npz"
    results_of(run("ref", "--data", setup["a"], "--dest", one, "--batch", 2, "--workers", 0, *setup["weights"]))
    two = tmp_path / "two.npz"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
         "calculate_metrics.py", "ref", "--data", str(setup["a"]), "--dest", str(two), "--batch", "2",
         "--workers", "0", *setup["weights"]],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["num_images"] == 12  # printed once, by rank 0
    assert_stats_close(metrics.load_stats(two), metrics.load_stats(one), rtol=1e-10)


def test_bad_input_gives_one_clear_line(setup, tmp_path):
    ref = tmp_path / "ref.npz"
    metrics.save_stats(direct_stats(setup, setup["b"]), ref)
    common = ["--ref", ref, *setup["weights"]]
    assert_one_error_line(run("calc", "--images", setup["a"], *common), "--images", "found 12 images",
                          "--num=50000")
    assert_one_error_line(run("calc", "--images", setup["a"], "--num", 12, "--metrics", "fid,kid", *common),
                          "--metrics", "unknown metric 'kid'", "fid, fd_dinov2")
    np.savez(tmp_path / "edm.npz", **metrics.load_stats(ref)["fid"])  # EDM's format: FID only
    assert_one_error_line(run("calc", "--images", setup["a"], "--num", 12, "--ref", tmp_path / "edm.npz",
                              *setup["weights"]), "--ref", "no statistics for fd_dinov2", "--metrics=fid")
    assert results_of(run("calc", "--images", setup["a"], "--num", 12, "--ref", tmp_path / "edm.npz",
                          "--metrics", "fid", *setup["weights"]))["results"].keys() == {"fid"}
    url = "http://127.0.0.1:9/inception-2015-12-05.pt"
    dest = tmp_path / "never.npz"
    assert_one_error_line(run("ref", "--data", setup["a"], "--dest", dest, *setup["weights"], "--inception", url),
                          "--inception", url, str(tmp_path / "cache"))
    assert not dest.exists()
    with open(tmp_path / "evil.pkl", "wb") as f:
        pickle.dump({"fid": {"mu": np.zeros(2), "sigma": np.eye(2)}, "x": __import__("os").getcwd}, f)
    assert_one_error_line(run("calc", "--images", setup["a"], "--num", 12, "--ref", tmp_path / "evil.pkl",
                              "--metrics", "fid", *setup["weights"]), "--ref", "refusing to load")
    assert_one_error_line(run("calc", "--images", tmp_path / "absent", "--num", 12, *common), "--images",
                          "no such directory or ZIP file")


def tiny_snapshot(path, label_dim, seed):
    torch.manual_seed(seed)
    net = randomized(tiny_precond(label_dim=label_dim), seed)
    save_network(path, net, {"encoder": StandardRGBEncoder().config()})
    return path


def test_gen_end_to_end_equals_sampling_then_measuring(setup, tmp_path):
    net_path = tiny_snapshot(tmp_path / "net.safetensors", label_dim=4, seed=1)
    gnet_path = tiny_snapshot(tmp_path / "gnet.safetensors", label_dim=0, seed=2)
    ref = direct_stats(setup, setup["a"])
    metrics.save_stats(ref, tmp_path / "a.npz")
    common = ["--ref", tmp_path / "a.npz", "--num", 4, "--seed", 3, "--batch", 4, *setup["weights"]]
    out = results_of(run("gen", "--net", net_path, "--gnet", gnet_path, "--guidance", 2, *common))
    assert out["num_images"] == 4

    # The same seeds sampled directly in one batch, then measured without the command line.
    net, gnet = load_network(net_path)[0], load_network(gnet_path)[0]
    batches = generate_images(net, StandardRGBEncoder(), range(3, 7), gnet=gnet, guidance=2.0, batch_size=4,
                              device="cpu")
    images = torch.cat([batch for _, batch in batches])
    stats = {}
    for metric, path in (("fid", "inception.pt"), ("fd_dinov2", "dinov2.pth")):
        features = detectors.load_detector(metric, setup["root"] / path)(images).double().numpy()
        stats[metric] = {"mu": features.mean(0), "sigma": np.cov(features, rowvar=False)}
    assert out["results"] == pytest.approx(expected_distances(stats, ref), rel=1e-5)

    assert_one_error_line(run("gen", "--net", net_path, "--guidance", 2, *common), "--gnet", "--guidance=2")
    assert_one_error_line(run("gen", "--net", tmp_path / "absent.safetensors", *common), "--net")
