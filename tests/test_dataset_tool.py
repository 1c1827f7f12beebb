"""dataset_tool.py: convert, encode (batched, resumable, torchrun), decode, toy, and its errors."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from click.testing import CliRunner

import dataset_tool
from edm2 import toy_shapes, transforms
from edm2.dataset import ImageFolderDataset, image_fname, latent_fname
from edm2.encoders import StabilityVAEEncoder
from tests.helpers import assert_one_error_line, free_port, save_tiny_vae

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return CliRunner().invoke(dataset_tool.main, [str(arg) for arg in args])


def assert_ok(result):
    assert result.exit_code == 0, result.output


def zip_contents(path):
    with zipfile.ZipFile(path) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def save_image(path, array):
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.Image.fromarray(array).save(path)


# ----------------------------------------------------------------------------------------------
# Must show 1: center-crop-dhariwal equals an independent computation of ADM's procedure, which
# resamples like PIL: separable (horizontal, then vertical), support scaled by the reduction
# factor, weights normalized, rounded to uint8 after each pass.

def box_filter(x):
    return ((x > -0.5) & (x <= 0.5)).astype(np.float64)


def bicubic_filter(x, a=-0.5):
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def resample_axis(image, out_size, kernel, support, axis):
    image = np.moveaxis(image.astype(np.float64), axis, 0)
    scale = image.shape[0] / out_size
    stretch = max(scale, 1.0)
    out = np.empty((out_size,) + image.shape[1:])
    for i in range(out_size):
        center = (i + 0.5) * scale
        lo = max(int(center - support * stretch + 0.5), 0)
        hi = min(int(center + support * stretch + 0.5), image.shape[0])
        weights = kernel((np.arange(lo, hi) - center + 0.5) / stretch)
        out[i] = np.tensordot(weights / weights.sum(), image[lo:hi], axes=1)
    return np.moveaxis(np.clip(np.floor(out + 0.5), 0, 255), 0, axis)


def reference_resize(image, width, height, kernel, support):
    if image.shape[1] != width:
        image = resample_axis(image, width, kernel, support, axis=1)
    if image.shape[0] != height:
        image = resample_axis(image, height, kernel, support, axis=0)
    return image


def reference_adm(image, size, halve=True):
    while halve and min(image.shape[:2]) >= 2 * size:
        image = reference_resize(image, image.shape[1] // 2, image.shape[0] // 2, box_filter, 0.5)
    scale = size / min(image.shape[:2])
    image = reference_resize(image, round(image.shape[1] * scale), round(image.shape[0] * scale), bicubic_filter, 2.0)
    top, left = (image.shape[0] - size) // 2, (image.shape[1] - size) // 2
    return image[top:top + size, left:left + size].astype(np.uint8)


@pytest.mark.parametrize("width, height, size", [
    (300, 200, 64), (200, 300, 64), (1001, 333, 64), (129, 257, 32), (97, 64, 32), (41, 23, 32), (64, 64, 64)])
def test_center_crop_dhariwal_equals_independent_adm(width, height, size):
    image = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    ours = transforms.center_crop_dhariwal(image, size).astype(int)
    expected = reference_adm(image, size).astype(int)
    assert ours.shape == (size, size, 3)
    # PIL's fixed-point weights may move a rare pixel by one level; any procedural slip moves most.
    assert np.abs(ours - expected).max() <= 1 and (ours != expected).mean() < 1e-3
    if min(width, height) >= 2 * size:
        assert (ours != reference_adm(image, size, halve=False)).mean() > 0.5


# ----------------------------------------------------------------------------------------------
# Must show 2: converted datasets read back with the right labels in the release's layout.

CLASS_COLOURS = {"cat": (200, 30, 30), "dog": (30, 200, 30), "eel": (30, 30, 200)}
SOURCE_FILES = [("cat/a.png", 40, 30), ("cat/b.JPEG", 30, 40), ("dog/c.png", 64, 64), ("dog/d.png", 33, 20),
                ("eel/e.png", 20, 50)]


@pytest.fixture
def class_folders(tmp_path):
    source = tmp_path / "train"
    for name, width, height in SOURCE_FILES:
        save_image(source / name, np.full((height, width, 3), CLASS_COLOURS[name.split("/")[0]], np.uint8))
    return source


@pytest.mark.parametrize("dest_name", ["out.zip", "out"])
def test_convert_reads_back_with_labels_in_release_layout(tmp_path, class_folders, dest_name):
    dest = tmp_path / dest_name
    assert_ok(run("convert", "--source", class_folders, "--dest", dest, "--resolution", 16,
                  "--transform", "center-crop"))
    names = [image_fname(i) for i in range(len(SOURCE_FILES))]
    labels = [sorted(CLASS_COLOURS).index(name.split("/")[0]) for name, _, _ in SOURCE_FILES]
    if dest_name.endswith(".zip"):
        with zipfile.ZipFile(dest) as archive:
            assert sorted(archive.namelist()) == sorted(names + ["dataset.json"])
            assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_STORED}
            metadata = json.loads(archive.read("dataset.json"))
    else:
        assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*.*")) == sorted(names + ["dataset.json"])
        metadata = json.loads((dest / "dataset.json").read_text())
    assert metadata == {"labels": [[name, label] for name, label in zip(names, labels)]}
    ds = ImageFolderDataset(dest)
    assert (len(ds), ds.resolution, ds.num_channels, ds.label_dim) == (5, 16, 3, 3)
    for i, (source_name, _, _) in enumerate(SOURCE_FILES):
        image, label = ds[i]
        assert label.argmax() == labels[i]
        colour = np.array(CLASS_COLOURS[source_name.split("/")[0]])
        assert np.abs(image.reshape(3, -1).mean(axis=1) - colour).max() < 3  # the JPEG is lossy


def test_convert_honours_release_dataset_json(tmp_path, class_folders):
    assert_ok(run("convert", "--source", class_folders, "--dest", tmp_path / "a.zip", "--resolution", 8,
                  "--transform", "center-crop"))
    relabeled = zip_contents(tmp_path / "a.zip")
    relabeled["dataset.json"] = json.dumps({"labels": [[image_fname(i), 7 - i] for i in range(5)]}).encode()
    with zipfile.ZipFile(tmp_path / "b.zip", "w") as archive:
        for name, data in relabeled.items():
            archive.writestr(name, data)
    assert_ok(run("convert", "--source", tmp_path / "b.zip", "--dest", tmp_path / "c", "--max-images", 4))
    original, copy = ImageFolderDataset(tmp_path / "a.zip"), ImageFolderDataset(tmp_path / "c")
    assert len(copy) == 4 and [copy[i][1].argmax() for i in range(4)] == [7, 6, 5, 4]
    assert all(np.array_equal(copy[i][0], original[i][0]) for i in range(4))


# ----------------------------------------------------------------------------------------------
# Must show 3: encode equals the encoder, resumes to the same result, and 2 processes equal 1.

@pytest.fixture(scope="module")
def encode_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("encode")
    assert_ok(run("toy", "--dest", root / "toy.zip", "--resolution", 16, "--num", 10, "--classes", 3))
    vae_dir = save_tiny_vae(root / "tiny-vae")
    reference = root / "reference.zip"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the per-test fixture, which module fixtures run outside of
    assert_ok(run("encode", "--source", root / "toy.zip", "--dest", reference, "--vae", vae_dir, "--batch", 3,
                  "--workers", 0))
    torch.set_num_threads(threads)
    return root, vae_dir, reference


def test_encode_writes_the_encoders_latents(encode_setup):
    root, vae_dir, reference = encode_setup
    source = ImageFolderDataset(root / "toy.zip")
    pixels = torch.from_numpy(np.stack([source[i][0] for i in range(len(source))]))
    expected = StabilityVAEEncoder(str(vae_dir), batch_size=3).encode_pixels(pixels).numpy()
    contents = zip_contents(reference)
    names = [latent_fname(i) for i in range(10)]
    assert sorted(contents) == sorted(names + ["dataset.json"])
    assert json.loads(contents["dataset.json"]) == {"labels": [[name, i % 3] for i, name in enumerate(names)]}
    latents = ImageFolderDataset(reference)
    assert (latents.num_channels, latents.resolution, latents.label_dim) == (8, 8, 3)
    for i in range(10):
        assert latents[i][0].dtype == np.float32 and np.array_equal(latents[i][0], expected[i])


def test_interrupted_encode_resumes_to_the_same_dataset(encode_setup, monkeypatch):
    root, vae_dir, reference = encode_setup
    dest = root / "resumed.zip"
    args = ["encode", "--source", root / "toy.zip", "--dest", dest, "--vae", vae_dir, "--batch", 3]
    original = StabilityVAEEncoder.encode_pixels
    calls = []

    def interrupt_third_batch(self, x):
        calls.append(len(x))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, x)

    monkeypatch.setattr(StabilityVAEEncoder, "encode_pixels", interrupt_third_batch)
    assert run(*args, "--workers", 0).exit_code != 0
    partial = root / "resumed.zip.partial"
    assert not dest.exists() and len(list(partial.glob("*/*.npy"))) == 6
    monkeypatch.setattr(StabilityVAEEncoder, "encode_pixels", original)
    assert_one_error_line(run(*args, "--max-images", 4), "resumed.zip.partial", "images 10 -> 4")
    result = run(*args, "--workers", 2)
    assert_ok(result)
    assert "6 of 10 images already encoded" in result.output
    assert dest.read_bytes() == reference.read_bytes() and not partial.exists()


def test_torchrun_two_processes_equal_one(encode_setup):
    root, vae_dir, reference = encode_setup
    dest = root / "two-processes"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               "dataset_tool.py", "encode", "--source", str(root / "toy.zip"), "--dest", str(dest),
               "--vae", str(vae_dir), "--batch", "3", "--workers", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    written = {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    assert written == zip_contents(reference)


def test_decode_writes_the_vae_decoding_of_the_mean(encode_setup, tmp_path):
    root, vae_dir, reference = encode_setup
    assert_ok(run("decode", "--source", reference, "--dest", tmp_path / "decoded.zip", "--vae", vae_dir,
                  "--max-images", 4))
    decoded, latents = ImageFolderDataset(tmp_path / "decoded.zip"), ImageFolderDataset(reference)
    means = torch.from_numpy(np.stack([latents[i][0][:4] for i in range(4)]))
    expected = StabilityVAEEncoder(str(vae_dir)).decode_raw(means).numpy()
    assert (len(decoded), decoded.resolution, decoded.num_channels) == (4, 16, 3)
    for i in range(4):
        assert np.array_equal(decoded[i][0], expected[i]) and decoded[i][1].argmax() == i % 3


# ----------------------------------------------------------------------------------------------
# Must show 4: bad input gives one clear line and writes nothing.

def test_corrupt_image_stops_or_is_skipped_by_name(tmp_path, class_folders):
    (class_folders / "dog" / "broken.png").write_bytes((class_folders / "dog" / "c.png").read_bytes()[:60])
    args = ["convert", "--source", class_folders, "--resolution", 8, "--transform", "center-crop"]
    assert_one_error_line(run(*args, "--dest", tmp_path / "stop.zip"), "dog/broken.png", "--on-error=skip")
    assert not (tmp_path / "stop.zip").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["train"]
    result = run(*args, "--dest", tmp_path / "skip.zip", "--on-error", "skip")
    assert_ok(result)
    assert "skipping dog/broken.png" in result.output and "(1 skipped)" in result.output
    assert len(ImageFolderDataset(tmp_path / "skip.zip")) == len(SOURCE_FILES)


def test_bad_arguments_give_one_line(tmp_path, class_folders, encode_setup):
    root, _, _ = encode_setup
    (tmp_path / "garbage.zip").write_bytes(b"not a zip")
    (tmp_path / "exists.zip").write_bytes(b"")
    save_image(tmp_path / "sizes" / "a.png", np.zeros((8, 8, 3), np.uint8))
    save_image(tmp_path / "sizes" / "b.png", np.zeros((10, 10, 3), np.uint8))
    convert = ["convert", "--source", class_folders, "--dest"]
    cases = [
        (["convert", "--source", tmp_path / "garbage.zip", "--dest", tmp_path / "x.zip"], ["--source", "ZIP"]),
        (["convert", "--source", tmp_path / "sizes", "--dest", tmp_path / "x.zip"],
         ["b.png is 10x10 but earlier images are 8x8", "--transform"]),
        (convert + [tmp_path / "x.zip"], ["a.png is 40x30, not square"]),
        (convert + [tmp_path / "x.zip", "--resolution", "64x32", "--transform", "center-crop-dhariwal"],
         ["--resolution", "square", "64x32"]),
        (convert + [tmp_path / "x.zip", "--transform", "center-crop"], ["--resolution"]),
        (convert + [tmp_path / "x.zip", "--resolution", "12y"], ["--resolution", "12y"]),
        (convert + [tmp_path / "exists.zip", "--resolution", 8], ["--dest", "already exists"]),
        (["toy", "--dest", tmp_path / "exists.zip"], ["--dest", "already exists"]),
        (["toy", "--dest", tmp_path / "t.zip", "--classes", 99], ["--classes", "99"]),
        (["encode", "--source", root / "toy.zip", "--dest", tmp_path / "exists.zip"], ["--dest", "already exists"]),
        (["encode", "--source", root / "toy.zip", "--dest", tmp_path / "e.zip", "--vae", tmp_path / "no-vae"],
         ["--vae", str(tmp_path / "no-vae")]),
        (["encode", "--source", root / "reference.zip", "--dest", tmp_path / "e.zip"], ["--source", ".png"]),
        (["decode", "--source", root / "toy.zip", "--dest", tmp_path / "d.zip"], ["--source", ".npy"]),
    ]
    for args, words in cases:
        assert_one_error_line(run(*args), *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists.zip", "garbage.zip", "sizes", "train"]


# ----------------------------------------------------------------------------------------------
# The toy dataset.

def test_toy_classes_are_shapes_that_nearest_neighbour_separates(tmp_path):
    assert_ok(run("toy", "--dest", tmp_path / "toy", "--resolution", 16, "--num", 240,
                  "--classes", len(toy_shapes.SHAPES)))
    ds = ImageFolderDataset(tmp_path / "toy")
    images = np.stack([ds[i][0] for i in range(len(ds))]).transpose(0, 2, 3, 1).astype(np.float64)
    labels = np.array([ds[i][1].argmax() for i in range(len(ds))])
    assert np.array_equal(labels, np.arange(240) % len(toy_shapes.SHAPES))
    # Foreground masks, shifted so their centroids coincide, must identify the class by 1-NN.
    masks = np.abs(images - toy_shapes.TOY_BACKGROUND).max(axis=-1)
    masks /= masks.max(axis=(1, 2), keepdims=True)
    rows, cols = np.mgrid[:16, :16]
    centred = np.stack([np.roll(m, (round(8 - (m * rows).sum() / m.sum()), round(8 - (m * cols).sum() / m.sum())),
                                axis=(0, 1)).ravel() for m in masks])
    distances = ((centred[:, None] - centred[None]) ** 2).sum(axis=-1)
    np.fill_diagonal(distances, np.inf)
    assert (labels[distances.argmin(axis=1)] == labels).mean() > 0.97


def test_toy_is_reproducible_from_the_seed(tmp_path):
    for name, seed in [("a.zip", 1), ("b.zip", 1), ("c.zip", 2)]:
        assert_ok(run("toy", "--dest", tmp_path / name, "--resolution", 8, "--num", 4, "--seed", seed))
    assert (tmp_path / "a.zip").read_bytes() == (tmp_path / "b.zip").read_bytes()
    assert (tmp_path / "a.zip").read_bytes() != (tmp_path / "c.zip").read_bytes()


def test_every_command_help_shows_an_example():
    for command in ["convert", "encode", "decode", "toy"]:
        result = run(command, "--help")
        assert_ok(result)
        assert f"dataset_tool.py {command} --" in result.output
