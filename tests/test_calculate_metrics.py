"""calculate_metrics.py end to end with tiny detectors on images the test writes; torchrun; bad input.

Tolerances follow from the arithmetic (see FLOAT32_PASS and fd_rounding): features are float32, statistics and
Frechet distances float64.
"""

import json
import hashlib
import math
import os
import pickle
import shlex
import shutil
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
import torch
from click.testing import CliRunner

import calculate_metrics
import dataset_tool
from edm2.encoders import StabilityVAEEncoder, StandardRGBEncoder
from edm2.eval import detectors, metrics, stats_files
from edm2.formats.snapshot import load_network, save_network
from edm2.procedures.generation import generate_images
from edm2.runtime.locks import hold_destination
from edm2.sampler import SELF
from edm2.runtime.distributed import free_port
from tests.helpers import (REPO, FileWritingInception, TinyInceptionStandIn, assert_one_error_line, assert_refused,
                           pin_detector_file, png_bomb_zip, png_file, random_dinov2_state_dict, randomized,
                           run_python_script, tiny_precond)

# One 64-channel head keeps the 64x64 covariances cheap for scipy's sqrtm.
DINOV2_CONFIG = dict(width=64, depth=1, patch=14, grid=5, mlp=128)
METRIC_WEIGHTS = (("fid", "inception.pt"), ("fd_dinov2", "dinov2.pth"))
U64 = np.finfo(np.float64).eps / 2
# Round-off of one float32 pass of the tiny detectors, relative to the largest feature: at most 12 reductions in
# sequence (DINOv2: patch embedding, layer norms, qkv, attention, projection, MLP; Inception stand-in: resize,
# convolution, linear), the longest of K = 3 * 14 * 14 = 588 terms, each off by <= sqrt(K) eps32. Another batch
# size, thread count or CPU may order the sums differently: two passes apart at most.
FLOAT32_PASS = 12 * math.sqrt(588) * torch.finfo(torch.float32).eps


def write_images(folder, num, seed, brightness, size=16):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for i in range(num):
        pixels = np.clip(rng.normal(brightness, 60, size=(size, size, 3)), 0, 255).astype(np.uint8)
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


@pytest.fixture(scope="module", autouse=True)
def published_standins(setup):
    """The tiny detectors stand in for the published files: their digests are the pinned ones (module-wide, as
    module fixtures compute statistics with them)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        for metric, name in METRIC_WEIGHTS:
            pin_detector_file(monkeypatch, metric, setup["root"] / name)
        yield


@pytest.fixture(scope="module")
def launcher(setup):
    """A script that runs calculate_metrics.py in a new process with the tiny detectors' digests pinned there too."""
    digests = {metric: hashlib.sha256((setup["root"] / name).read_bytes()).hexdigest()
               for metric, name in METRIC_WEIGHTS}
    path = setup["root"] / "pinned_calculate_metrics.py"
    path.write_text("import dataclasses, runpy, sys\n"
                    f"sys.path.insert(0, {str(REPO)!r})\n"
                    "from edm2.eval import detectors\n"
                    f"for metric, digest in {digests!r}.items():\n"
                    "    published = detectors.PUBLISHED[metric]\n"
                    "    detectors.PUBLISHED[metric] = dataclasses.replace(published, sha256=digest)\n"
                    f"runpy.run_path({str(REPO / 'calculate_metrics.py')!r}, run_name='__main__')\n")
    return path


def features_of(setup, images):
    """{metric: float64 features} of a uint8 batch, each detector called once on the whole batch."""
    return {metric: detectors.load_detector(metric, setup["root"] / path)(images).double().numpy()
            for metric, path in METRIC_WEIGHTS}


def direct_stats(setup, folder, indices=None, batch=None):
    """(statistics, largest |feature| per metric) without the command line: PIL images, NumPy mean/cov.

    With batch, the detectors see the images in the batches the command line makes of them (np.array_split
    into ceil(n / batch) parts), so both compute the same float32 features.
    """
    paths = sorted(folder.glob("*.png"))
    paths = [paths[i] for i in (range(len(paths)) if indices is None else indices)]
    images = torch.from_numpy(np.stack([np.array(PIL.Image.open(p)).transpose(2, 0, 1) for p in paths]))
    chunks = np.array_split(np.arange(len(paths)), math.ceil(len(paths) / (batch or len(paths))))
    parts = [features_of(setup, images[chunk]) for chunk in chunks]
    features = {metric: np.concatenate([part[metric] for part in parts]) for metric, _ in METRIC_WEIGHTS}
    stats = {m: {"mu": f.mean(0), "sigma": np.cov(f, rowvar=False)} for m, f in features.items()}
    return stats, {m: np.abs(f).max() for m, f in features.items()}


def run(*args):
    return CliRunner().invoke(calculate_metrics.main, [str(a) for a in args])


def results_of(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.splitlines()[-1])


def expected_distances(stats, ref):
    return {m: metrics.frechet_distance(stats[m]["mu"], stats[m]["sigma"], ref[m]["mu"], ref[m]["sigma"]) for m in ref}


def assert_stats_close(got, expected, scale):
    """Statistics of float32 features that may differ by two passes of round-off (FLOAT32_PASS * scale each).

    mu moves as much as the features; sigma_jk = sum_i (f_ij - mu_j)(f_ik - mu_k) / (n - 1) with |f - mu| <= 2 scale
    moves by <= 2 * 2 scale * error * n / (n - 1) <= 5 scale * error for n >= 5. The float64 sums add n U64
    scale^2, far below.
    """
    assert sorted(got) == sorted(expected)
    for metric in expected:
        error = 2 * FLOAT32_PASS * scale[metric]
        np.testing.assert_allclose(got[metric]["mu"], expected[metric]["mu"], rtol=0, atol=error)
        np.testing.assert_allclose(got[metric]["sigma"], expected[metric]["sigma"], rtol=0, atol=5 * scale[metric] * error)


def test_the_statistics_tolerance_covers_round_off_and_nothing_more():
    # Features another CPU computes differ in the last float32 digits (4e-7 of the feature scale was seen);
    # the derived tolerance admits that, and refuses a difference a wrong image or batch would make.
    rng = np.random.default_rng(0)
    features = rng.normal(0, 1, (12, 16)).astype(np.float32).astype(np.float64)
    scale = {"fid": np.abs(features).max()}

    def stats(f):
        return {"fid": {"mu": f.mean(0), "sigma": np.cov(f, rowvar=False)}}

    assert_stats_close(stats(features * (1 + 4e-7 * rng.choice([-1, 1], features.shape))), stats(features), scale)
    with pytest.raises(AssertionError):
        assert_stats_close(stats(features + 1e-3 * scale["fid"] * rng.standard_normal(features.shape)),
                           stats(features), scale)


def fd_rounding(stats, ref, n):
    """{metric: how far two float64 evaluations of the Frechet distance may be apart} for the same float32
    features whose statistics (n images; 0 for bit-identical statistics) were summed in different orders.

    Entries of mu and sigma move by <= 2 n U64 M (M: the largest second moment mu_j^2 + sigma_jj), so sigma's
    operator norm by <= d times that. scipy's sqrtm is backward stable: it roots S1 S2 + E, |E| <= d U64 |S1||S2|.
    By Weyl's inequality each of the d eigenvalues of the symmetric form S2^1/2 S1 S2^1/2 moves by at most
    |dS1||S2| + |S1||dS2| + |E|; the square root is Hoelder-1/2, so each root moves by at most the square root of
    that. With fewer images than dimensions the covariances are singular and this Hoelder bound is what holds.
    """
    bounds = {}
    for metric in ref:
        (mu1, s1), (mu2, s2) = [(np.asarray(x[metric]["mu"]), np.asarray(x[metric]["sigma"])) for x in (stats, ref)]
        d = len(mu1)
        moment = max(np.max(mu1 ** 2 + np.diag(s1)), np.max(mu2 ** 2 + np.diag(s2)))
        entry = 2 * n * U64 * moment
        norm1, norm2 = np.linalg.norm(s1, 2), np.linalg.norm(s2, 2)
        shift = d * entry * (norm1 + norm2) + d * U64 * norm1 * norm2
        mean_term = 2 * np.linalg.norm(mu1 - mu2) * math.sqrt(d * entry) + d * entry
        bounds[metric] = 2 * d * math.sqrt(shift) + 2 * d * entry + mean_term
    return bounds


def assert_distances_close(got, expected, bounds):
    assert sorted(got) == sorted(expected)
    for metric, value in expected.items():
        assert abs(got[metric] - value) <= bounds[metric], (metric, got[metric], value, bounds[metric])


def test_help_shows_examples():
    result = run("--help")
    assert result.exit_code == 0 and "calculate_metrics.py calc --images=out" in result.output


def test_ref_and_calc_end_to_end(setup, tmp_path):
    ref_a, scale_a = direct_stats(setup, setup["a"])
    result = run("ref", "--data", setup["a"], "--dest", tmp_path / "a.npz", "--batch", 5, "--workers", 0,
                 *setup["weights"])
    assert results_of(result)["num_images"] == 12
    written = stats_files.load_stats(tmp_path / "a.npz")
    assert_stats_close(written, ref_a, scale_a)  # batches of 4 against one batch of 12

    result = run("calc", "--images", setup["b"], "--ref", tmp_path / "a.npz", "--num", 10, "--workers", 1,
                 *setup["weights"])
    out = results_of(result)
    assert out["num_images"] == 10
    stats_b, _ = direct_stats(setup, setup["b"])  # one batch, as the command line's default --batch=64 makes
    expected = expected_distances(stats_b, written)
    assert_distances_close(out["results"], expected, fd_rounding(stats_b, written, n=10))
    assert min(expected.values()) > 1e-3
    assert result.stdout.splitlines()[-2].startswith(f"fid {out['results']['fid']:.4f}  fd_dinov2 ")

    # The same images in the same batches against their own statistics: identical statistics, so the distance
    # is 0 up to sqrtm's round-off on a singular (rank-11) covariance.
    out = results_of(run("calc", "--images", setup["a"], "--ref", tmp_path / "a.npz", "--num", 12, "--batch", 5,
                         *setup["weights"]))
    bounds = fd_rounding(written, written, n=0)
    assert all(abs(value) <= bounds[metric] for metric, value in out["results"].items()), (out, bounds)


def test_ref_reads_shards_as_the_folder_they_were_made_of(setup, tmp_path):
    shards = tmp_path / "a.shards"
    converted = CliRunner().invoke(dataset_tool.main, ["convert", "--source", str(setup["a"]), "--dest", str(shards),
                                                       "--shard-size", "5"])
    assert converted.exit_code == 0, converted.output
    for data, dest in ((setup["a"], "folder.npz"), (shards, "shards.npz")):
        results_of(run("ref", "--data", data, "--dest", tmp_path / dest, "--batch", 5, "--workers", 0,
                       *setup["weights"]))
    folder, sharded = (stats_files.load_stats(tmp_path / name) for name in ("folder.npz", "shards.npz"))
    assert folder.keys() == sharded.keys()
    for metric in folder:  # the same images in the same batches: the same statistics, bit for bit
        assert all(np.array_equal(folder[metric][k], sharded[metric][k]) for k in ("mu", "sigma"))


@pytest.mark.bad_input
def test_ref_into_a_dest_in_use_is_refused(setup, tmp_path):
    # Two refs into one --dest: the later replaced the other's statistics, both saying they saved them.
    dest = tmp_path / "a.npz"
    with hold_destination(dest, "calculate_metrics.py ref"):
        assert_refused(tmp_path, lambda: run("ref", "--data", setup["a"], "--dest", dest, "--workers", 0,
                                             *setup["weights"]),
                       f"{dest} is in use by the calculate_metrics.py ref process {os.getpid()} on host")


def test_calc_takes_a_seeded_random_subset(setup, tmp_path):
    ref_b, _ = direct_stats(setup, setup["b"])
    stats_files.save_stats(tmp_path / "b.pkl", ref_b)  # the release's format works as --ref too
    outs = [results_of(run("calc", "--images", setup["a"], "--ref", tmp_path / "b.pkl", "--num", 5, "--seed", seed,
                           "--batch", 2, "--workers", 0, *setup["weights"])) for seed in (7, 7, 8)]
    assert outs[0] == outs[1] and outs[0]["results"] != outs[2]["results"]
    subset = np.sort(np.random.RandomState(7).permutation(12)[:5])
    stats, _ = direct_stats(setup, setup["a"], subset, batch=2)
    assert_distances_close(outs[0]["results"], expected_distances(stats, ref_b), fd_rounding(stats, ref_b, n=5))


def test_calc_skips_the_grid_that_generate_writes(setup, tmp_path):
    images = tmp_path / "out"
    images.mkdir()
    for i, path in enumerate(sorted(setup["b"].glob("*.png"))):  # named by seed, as generate.py names them
        shutil.copy(path, images / f"{i:06d}.png")
    PIL.Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(images / "grid.png")  # generate.py --grid's overview
    ref, _ = direct_stats(setup, setup["a"])
    stats_files.save_stats(tmp_path / "a.npz", ref)
    common = ["--ref", tmp_path / "a.npz", "--num", 10, *setup["weights"]]
    with_grid = results_of(run("calc", "--images", images, *common))
    assert with_grid == {**results_of(run("calc", "--images", setup["b"], *common)), "images": str(images)}
    assert_one_error_line(run("calc", "--images", images, *common[:3], 11, *setup["weights"]), "found 10 images")


def test_calc_reads_every_format_pil_reads_in_folders_and_zips(setup, tmp_path):
    # WebP, JPEG, BMP, TIFF, GIF (palette), a grayscale JPEG and a CMYK JPEG in one folder: each is measured as
    # the RGB pixels PIL decodes from it (grayscale repeated to RGB, as metrics do with gray).
    mixed, decoded = tmp_path / "mixed", tmp_path / "decoded"
    mixed.mkdir(), decoded.mkdir()
    kinds = [("webp", "RGB", dict(lossless=True)), ("jpg", "RGB", {}), ("bmp", "RGB", {}), ("tiff", "RGB", {}),
             ("gif", "RGB", {}), ("jpeg", "L", {}), ("jpg", "CMYK", {})]
    for i, path in enumerate(sorted(setup["b"].glob("*.png"))):
        suffix, mode, options = kinds[i % len(kinds)]
        PIL.Image.open(path).convert(mode).save(mixed / f"{i:06d}.{suffix}", **options)
        with PIL.Image.open(mixed / f"{i:06d}.{suffix}") as image:
            assert image.mode == ("P" if suffix == "gif" else mode)
            image.convert("RGB").save(decoded / f"{i:06d}.png")
    zipped = dataset_zip(tmp_path / "mixed.zip", mixed)
    ref, _ = direct_stats(setup, setup["a"])
    stats_files.save_stats(tmp_path / "a.npz", ref)
    common = ["--ref", tmp_path / "a.npz", "--num", 10, *setup["weights"]]
    expected = results_of(run("calc", "--images", decoded, *common))
    for images in (mixed, zipped):
        assert results_of(run("calc", "--images", images, *common)) == {**expected, "images": str(images)}


def test_two_processes_give_the_statistics_of_one(setup, launcher, tmp_path):
    one = tmp_path / "one.npz"
    results_of(run("ref", "--data", setup["a"], "--dest", one, "--batch", 2, "--workers", 0, *setup["weights"]))
    two = tmp_path / "two.npz"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
         str(launcher), "ref", "--data", str(setup["a"]), "--dest", str(two), "--batch", "2",
         "--workers", "0", *setup["weights"]],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["num_images"] == 12  # printed once, by rank 0
    # The workers run with their own thread count, which may order float32 sums differently.
    assert_stats_close(stats_files.load_stats(two), stats_files.load_stats(one), direct_stats(setup, setup["a"])[1])


def tiny_snapshot(path, label_dim, seed, resolution=8, label_dropout=0.0):
    torch.manual_seed(seed)
    net = randomized(tiny_precond(img_resolution=resolution, label_dim=label_dim), seed)
    save_network(path, net, {"encoder": StandardRGBEncoder().config(),
                             "training_options": {"label_dropout": label_dropout}})
    return path


def latent_snapshot(path, vae):
    """A tiny latent-space snapshot (4 channels) that decodes with the VAE at `vae`."""
    save_network(path, tiny_precond(img_channels=4, label_dim=0), {"encoder": StabilityVAEEncoder(str(vae)).config()})
    return path


@pytest.mark.parametrize("guide", ["separate network", "self"])
def test_gen_end_to_end_equals_sampling_then_measuring(setup, tmp_path, guide):
    net_path = tiny_snapshot(tmp_path / "net.safetensors", label_dim=4, seed=1, label_dropout=0.1)
    gnet_path = tiny_snapshot(tmp_path / "gnet.safetensors", label_dim=0, seed=2) if guide != "self" else "self"
    ref, _ = direct_stats(setup, setup["a"])
    stats_files.save_stats(tmp_path / "a.npz", ref)
    common = ["--ref", tmp_path / "a.npz", "--num", 4, "--seed", 3, "--batch", 4, *setup["weights"]]
    out = results_of(run("gen", "--net", net_path, "--gnet", gnet_path, "--guidance", 2, *common))
    assert out["num_images"] == 4

    # The same seeds sampled directly in one batch, then measured without the command line.
    net, gnet = load_network(net_path)[0], SELF if guide == "self" else load_network(gnet_path)[0]
    batches = generate_images(net, StandardRGBEncoder(), range(3, 7), gnet=gnet, guidance=2.0, batch_size=4,
                              device="cpu")
    features = features_of(setup, torch.cat([batch for _, batch, _ in batches]))
    stats = {m: {"mu": f.mean(0), "sigma": np.cov(f, rowvar=False)} for m, f in features.items()}
    assert_distances_close(out["results"], expected_distances(stats, ref), fd_rounding(stats, ref, n=4))


def test_gen_guidance_interval_is_passed_to_the_sampler(setup, tmp_path, monkeypatch):
    net_path = tiny_snapshot(tmp_path / "net.safetensors", label_dim=4, seed=1)
    gnet_path = tiny_snapshot(tmp_path / "gnet.safetensors", label_dim=0, seed=2)
    ref, _ = direct_stats(setup, setup["a"])
    stats_files.save_stats(tmp_path / "a.npz", ref)
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs["guidance_interval"])
        return generate_images(*args, **kwargs)

    monkeypatch.setattr(calculate_metrics, "generate_images", spy)
    common = ["--ref", tmp_path / "a.npz", "--num", 2, "--batch", 2, *setup["weights"]]
    # An interval above sigma_max guides no step: the metrics of unguided sampling, exactly.
    unguided = results_of(run("gen", "--net", net_path, *common))
    empty = results_of(run("gen", "--net", net_path, "--gnet", gnet_path, "--guidance", 2, "--guidance-interval",
                           "100,200", *common))
    assert empty == unguided and calls == [None, (100.0, 200.0)]


# ---------------------------------------------------------------------------------------------------
# Bad input: one error line, a non-zero exit, nothing left behind, and no feature computed or image generated.

def write_latents(folder):
    folder.mkdir()
    for i in range(3):
        np.save(folder / f"img{i}.npy", np.zeros((4, 8, 8), np.float32))
    return folder


def dataset_zip(path, images):
    shutil.make_archive(str(path.with_suffix("")), "zip", images)
    return path


def evil_pickle(path):
    with open(path, "wb") as f:
        pickle.dump({"fid": {"mu": np.zeros(2), "sigma": np.eye(2)}, "x": __import__("os").getcwd}, f)
    return path


def edm_npz(path, setup):
    ref, _ = direct_stats(setup, setup["b"])
    np.savez(path, **ref["fid"])  # EDM's format: FID statistics only
    return path


def narrow_stats(path):
    stats_files.save_stats(path, {"fid": {"mu": np.zeros(5), "sigma": np.eye(5)},
                                  "fd_dinov2": {"mu": np.zeros(64), "sigma": np.eye(64)}})
    return path


def nan_mean_stats(path):
    stats_files.save_stats(path, {"fid": {"mu": np.full(12, np.nan), "sigma": np.eye(12)}})
    return path


def file_writing_inception(path, marker):
    torch.jit.save(torch.jit.script(FileWritingInception(str(marker))), path)
    return path


def snapshot_pair_of_other_resolutions(tmp_path):
    tiny_snapshot(tmp_path / "net.safetensors", label_dim=0, seed=1)
    return tiny_snapshot(tmp_path / "gnet16.safetensors", label_dim=0, seed=2, resolution=16)


# id -> (arguments given (setup, tmp_path, ref), fragments of the one error line, each a string or a function of
# tmp_path). The inputs a case needs are written before the run; the check compares the folder before and after.
BAD_INPUT = {
    # ref
    "ref dest suffix": (lambda s, t, r: ["ref", "--data", s["a"], "--dest", t / "a.json"], ["--dest", ".npz"]),
    "ref dest under a file": (lambda s, t, r: ["ref", "--data", s["a"], "--dest", (t / "f").write_text("x") and
                                               t / "f" / "a.npz"], ["--dest", "is a file"]),
    "ref dest is a folder": (lambda s, t, r: ["ref", "--data", s["a"], "--dest", (t / "d.npz").mkdir() or
                                              t / "d.npz"], ["--dest", "is a folder"]),
    "ref data absent": (lambda s, t, r: ["ref", "--data", t / "absent", "--dest", t / "a.npz"],
                        ["--data", "no such directory"]),
    "ref one image": (lambda s, t, r: ["ref", "--data", write_images(t / "one", 1, 0, 100), "--dest", t / "a.npz"],
                      ["--data", "1 image"]),
    "ref latents": (lambda s, t, r: ["ref", "--data", write_latents(t / "lat"), "--dest", t / "a.npz"],
                    ["--data", "float32", "decode"]),
    "ref inception url": (lambda s, t, r: ["ref", "--data", s["a"], "--dest", t / "a.npz", "--inception",
                                           "http://127.0.0.1:9/inception-2015-12-05.pt"],
                          ["--inception", "http://127.0.0.1:9/inception-2015-12-05.pt", lambda t: str(t / "cache")]),
    "ref inception absent": (lambda s, t, r: ["ref", "--data", s["a"], "--dest", t / "a.npz", "--inception",
                                              t / "absent.pt"], ["--inception", "not found"]),
    "ref inception writes files": (lambda s, t, r: ["ref", "--data", s["a"], "--dest", t / "a.npz", "--inception",
                                                    file_writing_inception(t / "evil.pt", t / "marker")],
                                   ["--inception", "evil.pt is not the published", "SHA-256"]),
    "ref dinov2 torchscript": (lambda s, t, r: ["ref", "--data", s["a"], "--dest", t / "a.npz", "--dinov2",
                                                s["root"] / "inception.pt"],
                               ["--dinov2", "inception.pt is not the published DINOv2"]),
    "ref metric": (lambda s, t, r: ["ref", "--data", s["a"], "--dest", t / "a.npz", "--metrics", "fd_clip"],
                   ["--metrics", "unknown metric 'fd_clip'"]),
    "ref batch": (lambda s, t, r: ["ref", "--data", s["a"], "--dest", t / "a.npz", "--batch", 0], ["--batch"]),
    # calc
    "calc too few images": (lambda s, t, r: ["calc", "--images", s["a"], "--ref", r], ["--images", "found 12 images",
                                                                                        "--num=50000"]),
    "calc metric": (lambda s, t, r: ["calc", "--images", s["a"], "--num", 12, "--ref", r, "--metrics", "fid,fd_clip"],
                    ["--metrics", "unknown metric 'fd_clip'", "fid, fd_dinov2"]),
    "calc ref lacks a metric": (lambda s, t, r: ["calc", "--images", s["a"], "--num", 12, "--ref",
                                                 edm_npz(t / "edm.npz", s)],
                                ["--ref", "no statistics for fd_dinov2", "--metrics=fid"]),
    "calc ref carries code": (lambda s, t, r: ["calc", "--images", s["a"], "--num", 12, "--metrics", "fid", "--ref",
                                               evil_pickle(t / "evil.pkl")], ["--ref", "refusing to load"]),
    "calc ref with a NaN mean": (lambda s, t, r: ["calc", "--images", s["a"], "--num", 12, "--metrics", "fid",
                                                  "--ref", nan_mean_stats(t / "nan.npz")],
                                 ["--ref", "nan.npz: metric 'fid' has a mu or sigma that is not finite"]),
    "calc ref absent": (lambda s, t, r: ["calc", "--images", s["a"], "--num", 12, "--ref", t / "absent.npz"],
                        ["--ref", "cannot read"]),
    "calc ref garbage": (lambda s, t, r: ["calc", "--images", s["a"], "--num", 12, "--ref",
                                          (t / "g.pkl").write_bytes(b"\x80\x04junk") and t / "g.pkl"],
                         ["--ref", "g.pkl"]),
    "calc ref is a dataset zip": (lambda s, t, r: ["calc", "--images", s["a"], "--num", 12, "--ref",
                                                   dataset_zip(t / "img.zip", s["b"])],
                                  ["--ref", "img.zip is a ZIP of images", "calculate_metrics.py ref --data="]),
    "calc ref is an image folder": (lambda s, t, r: ["calc", "--images", s["a"], "--num", 12, "--ref", s["b"]],
                                    ["--ref", "is a folder", "calculate_metrics.py ref --data="]),
    "calc ref of another detector": (lambda s, t, r: ["calc", "--images", s["a"], "--num", 12, "--ref",
                                                      narrow_stats(t / "n.npz")],
                                     ["--ref", "5-dimensional fid statistics", "gives 12 features"]),
    "calc images absent": (lambda s, t, r: ["calc", "--images", t / "absent", "--num", 12, "--ref", r],
                           ["--images", "no such directory or ZIP file"]),
    "calc inception writes files": (lambda s, t, r: ["calc", "--images", s["a"], "--num", 12, "--ref", r,
                                                     "--inception", file_writing_inception(t / "e.pt", t / "m")],
                                    ["--inception", "e.pt is not the published", "SHA-256"]),
    "calc seed": (lambda s, t, r: ["calc", "--images", s["a"], "--num", 12, "--ref", r, "--seed", -1], ["--seed"]),
    # gen
    "gen guidance nan": (lambda s, t, r: ["gen", "--net", tiny_snapshot(t / "n.safetensors", 0, 1), "--ref", r,
                                          "--guidance", "nan"], ["--guidance", "not a finite number"]),
    "gen seeds past 2**32": (lambda s, t, r: ["gen", "--net", tiny_snapshot(t / "n.safetensors", 0, 1), "--ref", r,
                                              "--seed", 2**32 - 10, "--num", 11], ["--seed", "below 2**32"]),
    "gen guidance inf": (lambda s, t, r: ["gen", "--net", tiny_snapshot(t / "n.safetensors", 0, 1), "--ref", r,
                                          "--guidance", "inf"], ["--guidance", "not a finite number"]),
    "gen guidance 1e308": (lambda s, t, r: ["gen", "--net", tiny_snapshot(t / "n.safetensors", 0, 1), "--ref", r,
                                            "--gnet=self", "--guidance", "1e308"], ["--guidance", "1e+308", "float32"]),
    "gen guidance without gnet": (lambda s, t, r: ["gen", "--net", tiny_snapshot(t / "n.safetensors", 0, 1),
                                                   "--ref", r, "--guidance", 2], ["--gnet", "--guidance=2"]),
    "gen net absent": (lambda s, t, r: ["gen", "--net", t / "absent.safetensors", "--ref", r], ["--net"]),
    # Our own latent-space snapshot whose VAE cannot load (offline): refused before any image is generated.
    "gen net without its vae": (lambda s, t, r: ["gen", "--net", latent_snapshot(t / "n.safetensors", t / "no-vae"),
                                                 "--ref", r, "--num", 2], ["--net", "cannot load the VAE", "no-vae"]),
    "gen self without label dropout": (lambda s, t, r: ["gen", "--net", tiny_snapshot(t / "n.safetensors", 4, 1),
                                                        "--ref", r, "--guidance", 2, "--gnet=self"],
                                       ["--gnet", "trained with label dropout"]),
    "gen self of an unconditional net": (lambda s, t, r: ["gen", "--net", tiny_snapshot(t / "n.safetensors", 0, 1,
                                                          label_dropout=0.1), "--ref", r, "--guidance", 2,
                                                          "--gnet=self"], ["--gnet", "unconditional"]),
    "gen gnet of another resolution": (lambda s, t, r: ["gen", "--net", t / "net.safetensors", "--gnet",
                                                        snapshot_pair_of_other_resolutions(t), "--guidance", 2,
                                                        "--ref", r], ["--gnet", "resolution"]),
    "gen ref of another detector": (lambda s, t, r: ["gen", "--net", tiny_snapshot(t / "n.safetensors", 0, 1),
                                                     "--ref", narrow_stats(t / "n.npz")],
                                    ["--ref", "5-dimensional fid statistics"]),
    "gen num": (lambda s, t, r: ["gen", "--net", tiny_snapshot(t / "n.safetensors", 0, 1), "--ref", r, "--num", 1],
                ["--num"]),
    "gen interval without guidance": (lambda s, t, r: ["gen", "--net", tiny_snapshot(t / "n.safetensors", 0, 1),
                                                       "--ref", r, "--guidance-interval", "0.28,5.42"],
                                      ["--guidance-interval", "--guidance other than 1"]),
    "gen interval reversed": (lambda s, t, r: ["gen", "--net", tiny_snapshot(t / "n.safetensors", 0, 1), "--ref", r,
                                               "--guidance", 2, "--gnet", t / "n.safetensors",
                                               "--guidance-interval", "5,1"], ["--guidance-interval", "'5,1'"]),
    "gen unknown solver": (lambda s, t, r: ["gen", "--net", tiny_snapshot(t / "n.safetensors", 0, 1), "--ref", r,
                                            "--solver", "rk4"], ["--solver", "'rk4'", "'dpm2m'"]),
    "gen interval garbage": (lambda s, t, r: ["gen", "--net", tiny_snapshot(t / "n.safetensors", 0, 1), "--ref", r,
                                              "--guidance", 2, "--gnet", t / "n.safetensors",
                                              "--guidance-interval", "low,high"], ["--guidance-interval", "two numbers"]),
}


@pytest.fixture(scope="module")
def ref_b(setup):
    path = setup["root"] / "ref_b.npz"
    stats_files.save_stats(path, direct_stats(setup, setup["b"])[0])
    return path


def refuse_work(*args, **kwargs):
    raise AssertionError("bad input must be refused before features are computed or images generated")


@pytest.mark.bad_input
@pytest.mark.parametrize("arguments, fragments", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_gives_one_clear_line(setup, ref_b, tmp_path, monkeypatch, arguments, fragments):
    monkeypatch.setattr(calculate_metrics, "calculate_stats", refuse_work)
    monkeypatch.setattr(calculate_metrics, "generate_images", refuse_work)
    args = arguments(setup, tmp_path, ref_b)
    weights = [w for option, path in zip(setup["weights"][::2], setup["weights"][1::2]) if option not in args
               for w in (option, path)]
    assert_refused(tmp_path, lambda: run(*args, *weights), *[f(tmp_path) if callable(f) else f for f in fragments])


@pytest.mark.bad_input
def test_an_unreadable_image_mid_way_is_one_line(setup, tmp_path):
    images = tmp_path / "images"
    shutil.copytree(setup["a"], images)
    (images / "img0007.png").write_bytes(b"\x89PNG truncated")
    args = ["ref", "--data", images, "--dest", tmp_path / "a.npz", "--batch", 4, "--workers", 1, *setup["weights"]]
    assert_refused(tmp_path, lambda: run(*args), "img0007.png")


def test_edm_npz_serves_fid_alone(setup, tmp_path):
    out = results_of(run("calc", "--images", setup["a"], "--num", 12, "--ref", edm_npz(tmp_path / "edm.npz", setup),
                         "--metrics", "fid", *setup["weights"]))
    assert out["results"].keys() == {"fid"}


# ---------------------------------------------------------------------------------------------------
# --dest on a read-only or full filesystem, and temporaries a killed run left behind.

def run_in_tmpfs(script, folder, mount_options, args):
    """Run calculate_metrics.py (through `script`) with a fresh tmpfs mounted on folder (private mount namespace);
    the output, exit code and the tmpfs's files afterwards."""
    folder.mkdir()
    command = (f"mount -t tmpfs -o {mount_options} tmpfs {folder} && "
               f"{sys.executable} {shlex.quote(str(script))} {' '.join(map(str, args))}; echo \"exit=$?\"; "
               f"ls -A {folder}")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", command], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    if "mount" in proc.stderr and "exit=" not in proc.stdout:
        pytest.skip(f"cannot mount here: {proc.stderr.strip()}")
    output, _, listing = proc.stdout.partition("exit=")
    code, _, files = listing.partition("\n")
    return subprocess.CompletedProcess(args, int(code), output, proc.stderr), files.split()


@pytest.mark.bad_input
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare to mount a tmpfs")
@pytest.mark.parametrize("mount_options, fragments", [("ro", ["--dest", "Read-only file system"]),
                                                      ("size=16k", ["a.npz", "No space left on device"])],
                         ids=["read-only", "full"])
def test_ref_dest_on_a_read_only_or_full_filesystem(setup, launcher, tmp_path, mount_options, fragments):
    # 64x64 float64 DINOv2 statistics (32 KiB) do not fit in 16 KiB. A read-only folder is refused before any
    # work: before the (bad) --dinov2 weights would be loaded.
    dinov2 = setup["root"] / "dinov2.pth" if mount_options != "ro" else tmp_path / "absent.pth"
    args = ["ref", "--data", setup["a"], "--dest", tmp_path / "out" / "a.npz", "--workers", 0,
            "--inception", setup["root"] / "inception.pt", "--dinov2", dinov2]
    result, left = run_in_tmpfs(launcher, tmp_path / "out", mount_options, args)
    assert_one_error_line(result, *fragments)
    assert left == []


def test_ref_removes_what_a_killed_run_left(setup, tmp_path):
    dest = tmp_path / "a.npz"
    script = ("import os, sys; from edm2.runtime import files\n"
              "with files.atomic_path(sys.argv[1]) as tmp:\n"
              "    tmp.write_bytes(b'half'); os._exit(9)\n")
    assert subprocess.run([sys.executable, "-c", script, str(dest)], cwd=REPO).returncode == 9
    assert len(list(tmp_path.glob(".a.npz.*.tmp"))) == 1
    results_of(run("ref", "--data", setup["a"], "--dest", dest, "--workers", 0, *setup["weights"]))
    assert [p.name for p in tmp_path.iterdir()] == ["a.npz"]


@pytest.mark.bad_input
def test_ref_refuses_a_decompression_bomb_within_a_memory_bound(tmp_path):
    # Its address space capped at what reading two small images needs (the run then stops at a missing detector
    # file) plus 1 GiB: a PNG of 8200x8200 RGBA (256 MiB, beyond edm2.data.dataset_files.MAX_IMAGE_PIXELS) is refused
    # from its header.
    small = tmp_path / "small"
    small.mkdir()
    for name in ("a.png", "b.png"):
        (small / name).write_bytes(png_file(np.zeros((8, 8, 3), np.uint8)))
    common = [f"--dest={tmp_path / 'ref.npz'}", "--metrics=fid", f"--inception={tmp_path / 'missing.pt'}"]
    result, peak = run_python_script(["calculate_metrics.py", "ref", f"--data={small}", *common])
    assert_one_error_line(result, "missing.pt")
    (tmp_path / "bombs").mkdir()
    bomb = png_bomb_zip(tmp_path / "bombs", 8200, 4, name="a.png")
    args = ["calculate_metrics.py", "ref", f"--data={bomb}", *common]
    assert_refused(tmp_path, lambda: run_python_script(args, peak + (1 << 30))[0], "--data", "a.png",
                   "declares 8200x8200 pixels")
