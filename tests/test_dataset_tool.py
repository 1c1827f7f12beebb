"""dataset_tool.py: convert, encode (batched, resumable, torchrun), decode, toy; its malformed inputs, read-only
and full disks, and the temporaries of killed runs."""

import json
import os
import signal
import socket
import subprocess
import sys
import warnings
import zipfile

import numpy as np
import PIL.Image
import pytest
import torch
from click.testing import CliRunner

from edm2.data import toy_shapes
from edm2.data.dataset import ImageFolderDataset, image_fname, latent_fname
from edm2.data.shards import ShardDataset
from edm2.encoders import StabilityVAEEncoder
from edm2.runtime import files
from edm2.runtime.locks import DestinationLock
from edm2.runtime.distributed import free_port
from tests.helpers import (REPO, assert_ok, assert_one_error_line, assert_refused, dead_pid, png_bomb_zip, png_file,
                           run_dataset_tool as run, run_python_script, save_tiny_vae, wait_for, write_members)




def zip_contents(path):
    with zipfile.ZipFile(path) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def save_image(path, array):
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.Image.fromarray(array).save(path)


@pytest.fixture
def one_thread():
    """Latents compared bit for bit with the module's reference encode are computed on its one thread too:
    a convolution split over other thread counts may sum in another order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------
# Converted datasets read back with the right labels in the release's layout.

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
    assert metadata == {"labels": [[name, label] for name, label in zip(names, labels)],
                        "classes": {"cat": 0, "dog": 1, "eel": 2}, "encoding": "pixels"}
    ds = ImageFolderDataset(dest)
    assert (len(ds), ds.resolution, ds.num_channels, ds.label_dim) == (5, 16, 3, 3)
    for i, (source_name, _, _) in enumerate(SOURCE_FILES):
        image, label = ds[i]
        assert label.argmax() == labels[i]
        colour = np.array(CLASS_COLOURS[source_name.split("/")[0]])
        # The JPEG (PIL's quality 75) keeps a flat colour up to its DC quantization: steps 8 (luma) and 9
        # (chroma) of a DC term 8x the mean move the mean by <= 0.25 and 0.56 levels, which YCbCr -> RGB
        # (x1.772 at most) makes <= 1.25, plus <= 0.5 for each of the two colour conversions' rounding and
        # 0.5 for the resize's: < 3. The PNGs are exact (the resize of a flat image is flat).
        assert np.abs(image.reshape(3, -1).mean(axis=1) - colour).max() < 3


def test_convert_follows_symlinked_class_folders(tmp_path, class_folders):
    # A class folder that is a link to a folder elsewhere (a newcomer's layout), and a link looping back.
    elsewhere = tmp_path / "elsewhere"
    (class_folders / "dog").rename(elsewhere)
    (class_folders / "dog").symlink_to(elsewhere, target_is_directory=True)
    (class_folders / "cat" / "loop").symlink_to(class_folders, target_is_directory=True)
    result = run("convert", "--source", class_folders, "--dest", tmp_path / "out.zip", "--resolution", 8,
                 "--transform", "center-crop", "--workers", 0)
    assert_ok(result)
    assert "wrote 5 RGB images" in result.output and "  1: dog" in result.output
    ds = ImageFolderDataset(tmp_path / "out.zip")
    assert [int(ds.get_label(i).argmax()) for i in range(len(ds))] == [0, 0, 1, 1, 2]


@pytest.mark.bad_input
def test_convert_refuses_decompression_bombs_within_a_memory_bound(tmp_path):
    # Its address space capped at what converting a small image needs plus 1 GiB: a PNG inflating to 3 GiB (PIL's
    # own bound) and one of 256 MiB (8200x8200 RGBA, beyond edm2.data.dataset.MAX_IMAGE_PIXELS) are refused unread.
    small = write_members(tmp_path / "small", {"a.png": png_file(np.zeros((8, 8, 3), np.uint8))})
    result, peak = run_python_script(["dataset_tool.py", "convert", f"--source={small}",
                                      f"--dest={tmp_path / 'small.zip'}", "--workers=0"])
    assert result.returncode == 0 and peak > 0, result.stdout + result.stderr
    for side, channels, words in [(32768, 3, "decompression bomb"), (8200, 4, "declares 8200x8200 pixels")]:
        (tmp_path / "bombs").mkdir(exist_ok=True)
        source = png_bomb_zip(tmp_path / "bombs", side, channels, name="a.png")
        args = ["dataset_tool.py", "convert", f"--source={source}", f"--dest={tmp_path / 'out.zip'}", "--workers=0"]
        assert_refused(tmp_path, lambda: run_python_script(args, peak + (1 << 30))[0], "a.png", words)


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


def gray_and_colour_sources(tmp_path):
    """Two sources of 6x6 images: all grayscale (PIL modes L, 1 and LA), and the same plus one RGB image."""
    rng = np.random.default_rng(0)
    gray = rng.integers(0, 256, size=(3, 6, 6), dtype=np.uint8)
    members = {"a.png": png_file(gray[0]), "b.png": png_file(gray[1] > 127),
               "c.png": png_file(np.stack([gray[2], gray[0]], axis=-1))}
    colour = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
    return (write_members(tmp_path / "gray", members),
            write_members(tmp_path / "mixed", {**members, "d.png": png_file(colour)}), gray, colour)


@pytest.mark.parametrize("channels", ["auto", "1", "3"])
def test_convert_keeps_grayscale_one_channel_unless_told_or_mixed(tmp_path, channels):
    gray_source, mixed_source, gray, colour = gray_and_colour_sources(tmp_path)
    for source in (gray_source, mixed_source):
        dest = tmp_path / f"{source.name}-{channels}.zip"
        result = run("convert", "--source", source, "--dest", dest, "--channels", channels, "--workers", 0)
        assert_ok(result)
        one = channels == "1" or (channels == "auto" and source == gray_source)
        assert ("grayscale (1 channel) images" if one else "RGB images") in result.output
        dataset = ImageFolderDataset(dest)
        assert dataset.num_channels == (1 if one else 3) and len(dataset) == len(list(source.iterdir()))
        # PIL's own conversions: bilevel -> 0/255, LA -> its L channel, gray -> RGB repeats it, RGB -> L is luma.
        expected = [gray[0], np.where(gray[1] > 127, 255, 0).astype(np.uint8), gray[2]]
        if source == mixed_source:
            expected.append(np.asarray(PIL.Image.fromarray(colour).convert("L")) if one else colour)
        for i, pixels in enumerate(expected):
            pixels = pixels if pixels.ndim == 3 else (pixels[:, :, None] if one else np.repeat(pixels[:, :, None], 3, 2))
            assert np.array_equal(dataset[i][0], pixels.transpose(2, 0, 1)), (source.name, i)
        assert "labels from the class folders" not in result.output  # no class folders, no labels


def test_convert_center_crop_wide_pads_grayscale_too(tmp_path):
    source = write_members(tmp_path / "wide", {"a.png": png_file(np.full((4, 8), 200, np.uint8))})
    assert_ok(run("convert", "--source", source, "--dest", tmp_path / "o", "--resolution", "8x4",
                  "--transform", "center-crop-wide", "--workers", 0))
    image = ImageFolderDataset(tmp_path / "o")[0][0]
    assert image.shape == (1, 8, 8) and (image[0, 2:6] == 200).all() and (image[0, [0, 1, 6, 7]] == 0).all()


# ----------------------------------------------------------------------------------------------
# encode equals the encoder, resumes to the same result, and 2 processes equal 1; decode.

@pytest.fixture(scope="module")
def encode_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("encode")
    assert_ok(run("toy", "--dest", root / "toy.zip", "--resolution", 16, "--num", 10, "--classes", 3))
    vae_dir = save_tiny_vae(root / "tiny-vae")
    reference = root / "reference.zip"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun's workers (OMP_NUM_THREADS=1) and the one_thread fixture
    assert_ok(run("encode", "--source", root / "toy.zip", "--dest", reference, "--vae", vae_dir, "--batch", 3,
                  "--workers", 0))
    torch.set_num_threads(threads)
    return root, vae_dir, reference


def test_encode_writes_the_encoders_latents(encode_setup, one_thread):
    root, vae_dir, reference = encode_setup
    source = ImageFolderDataset(root / "toy.zip")
    pixels = torch.from_numpy(np.stack([source[i][0] for i in range(len(source))]))
    expected = StabilityVAEEncoder(str(vae_dir), batch_size=3).encode_pixels(pixels).numpy()
    contents = zip_contents(reference)
    names = [latent_fname(i) for i in range(10)]
    assert sorted(contents) == sorted(names + ["dataset.json"])
    assert json.loads(contents["dataset.json"]) == {"labels": [[name, i % 3] for i, name in enumerate(names)],
                                                    "encoding": "stability-vae",
                                                    "encoding_settings": {"vae_name": str(vae_dir),
                                                                          "raw_mean": [5.81, 3.25, 0.12, -2.15],
                                                                          "raw_std": [4.17, 4.62, 3.71, 3.28],
                                                                          "final_mean": 0.0, "final_std": 0.5}}
    latents = ImageFolderDataset(reference)
    assert (latents.num_channels, latents.resolution, latents.label_dim) == (8, 8, 3)
    for i in range(10):
        assert latents[i][0].dtype == np.float32 and np.array_equal(latents[i][0], expected[i])


def test_interrupted_encode_resumes_to_the_same_dataset(encode_setup, monkeypatch, one_thread):
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
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
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
# Bad input: one clear line, a non-zero exit, and nothing written.

def test_corrupt_image_is_skipped_by_name(tmp_path, class_folders):
    (class_folders / "dog" / "broken.png").write_bytes((class_folders / "dog" / "c.png").read_bytes()[:60])
    result = run("convert", "--source", class_folders, "--resolution", 8, "--transform", "center-crop",
                 "--dest", tmp_path / "skip.zip", "--on-error", "skip")
    assert_ok(result)
    assert "skipping dog/broken.png" in result.output and "(1 skipped)" in result.output
    assert len(ImageFolderDataset(tmp_path / "skip.zip")) == len(SOURCE_FILES)


def labeled_source(tmp_path, label_of_b):
    """Two square images and a dataset.json whose second label is the JSON text label_of_b."""
    labels = b'{"labels": [["a.png", 0], ["b.png", ' + label_of_b + b"]]}"
    square = png_file(np.zeros((8, 8, 3), np.uint8))
    return write_members(tmp_path / "labeled", {"a.png": square, "b.png": square, "dataset.json": labels})


def source_with(tmp_path, members):
    return write_members(tmp_path / "source", members)


def corrupt_zip_member(tmp_path):
    """A ZIP whose one image fails its CRC check, as a bad disk or an interrupted copy leaves it."""
    path = write_members(tmp_path, {"a.png": png_file(np.full((8, 8, 3), 7, np.uint8))}, "flipped.zip")
    data = bytearray(path.read_bytes())
    data[60] ^= 0xFF  # inside the stored PNG bytes, after the 30-byte local header and the name
    path.write_bytes(bytes(data))
    return path


def grayscale_dataset(tmp_path):
    return write_members(tmp_path / "gray", {image_fname(0): png_file(np.zeros((8, 8), np.uint8)),
                                             "dataset.json": b'{"labels": null}'})


def three_channel_latents(tmp_path):
    latent = np.zeros((3, 4, 4), np.float32)
    with open(tmp_path / "latent.npy", "wb") as f:
        np.save(f, latent)
    data = (tmp_path / "latent.npy").read_bytes()
    (tmp_path / "latent.npy").unlink()
    return write_members(tmp_path / "odd", {latent_fname(0): data, "dataset.json": b'{"labels": null}'})


def not_an_encode(tmp_path, manifest="[1, 2]"):
    (tmp_path / "e.zip.partial").mkdir()
    (tmp_path / "e.zip.partial" / "encode.json").write_text(manifest)
    return tmp_path / "e.zip"


def junk(tmp_path, name):
    (tmp_path / name).write_bytes(b"junk")
    return tmp_path / name


def a_file(tmp_path):
    return junk(tmp_path, "file")


TORCHRUN = {"WORLD_SIZE": "2"}
# Each case: (arguments, built from t = tmp_path, s = the encode setup and c = class folders; the words
# the error line holds; the environment). Builders run before the tree of tmp_path is recorded.
BAD_INPUT = {
    "convert: source a corrupt ZIP": (
        lambda t, s, c: ["convert", "--source", junk(t, "x.zip"), "--dest", t / "o.zip"],
        ["--source", "not a readable ZIP"], None),
    "convert: source missing": (
        lambda t, s, c: ["convert", "--source", t / "nothing", "--dest", t / "o.zip"], ["--source", "does not exist"],
        None),
    "convert: source without images": (
        lambda t, s, c: ["convert", "--source", source_with(t, {"notes.txt": b"x"}), "--dest", t / "o.zip"],
        ["--source", "holds no images"], None),
    "convert: sizes differ": (
        lambda t, s, c: ["convert", "--source", source_with(t, {"a.png": png_file(np.zeros((8, 8, 3), np.uint8)),
                                                               "b.png": png_file(np.zeros((10, 10, 3), np.uint8))}),
                         "--dest", t / "o.zip"], ["b.png is 10x10 but earlier images are 8x8", "--transform"], None),
    "convert: not square": (
        lambda t, s, c: ["convert", "--source", c, "--dest", t / "o.zip"], ["a.png is 40x30, not square"], None),
    "convert: dhariwal crop not square": (
        lambda t, s, c: ["convert", "--source", c, "--dest", t / "o.zip", "--resolution", "64x32",
                         "--transform", "center-crop-dhariwal"], ["--resolution", "square", "64x32"], None),
    "convert: wide crop taller than wide": (
        lambda t, s, c: ["convert", "--source", c, "--dest", t / "o.zip", "--resolution", "32x64",
                         "--transform", "center-crop-wide"], ["--resolution", "width >= height", "32x64"], None),
    "convert: transform without resolution": (
        lambda t, s, c: ["convert", "--source", c, "--dest", t / "o.zip", "--transform", "center-crop"],
        ["--resolution"], None),
    "convert: resolution garbage": (
        lambda t, s, c: ["convert", "--source", c, "--dest", t / "o.zip", "--resolution", "12y"],
        ["--resolution", "12y"], None),
    "convert: resolution 0": (
        lambda t, s, c: ["convert", "--source", c, "--dest", t / "o.zip", "--resolution", "0"],
        ["--resolution", "'0'"], None),
    "convert: resolution 64x0": (
        lambda t, s, c: ["convert", "--source", c, "--dest", t / "o.zip", "--resolution", "64x0",
                         "--transform", "center-crop-wide"], ["--resolution", "64x0"], None),
    "convert: max-images 0": (
        lambda t, s, c: ["convert", "--source", c, "--dest", t / "o.zip", "--max-images", "0"], ["--max-images"],
        None),
    "convert: unknown transform": (
        lambda t, s, c: ["convert", "--source", c, "--dest", t / "o.zip", "--resolution", "8", "--transform", "zoom"],
        ["--transform", "zoom"], None),
    "convert: corrupt image": (
        lambda t, s, c: ["convert", "--source", source_with(t, {"a.png": png_file(np.zeros((8, 8, 3), np.uint8)),
                                                               "b.png": b"\x89PNG broken"}),
                         "--dest", t / "o.zip"], ["b.png", "--on-error=skip"], None),
    "convert: no image readable": (
        lambda t, s, c: ["convert", "--source", source_with(t, {"a.png": b"junk", "b.jpg": b"junk"}),
                         "--dest", t / "o.zip", "--on-error", "skip"], ["no image of", "could be read"], None),
    "convert: ZIP member fails its CRC": (
        lambda t, s, c: ["convert", "--source", corrupt_zip_member(t), "--dest", t / "o.zip"],
        ["a.png", "CRC", "--on-error=skip"], None),
    "convert: dataset.json not JSON": (
        lambda t, s, c: ["convert", "--source", source_with(t, {"a.png": png_file(np.zeros((8, 8, 3), np.uint8)),
                                                               "dataset.json": b"{labels"}),
                         "--dest", t / "o.zip"], ["--source", "dataset.json is not in the release format"], None),
    "convert: dataset.json without labels": (
        lambda t, s, c: ["convert", "--source", source_with(t, {"a.png": png_file(np.zeros((8, 8, 3), np.uint8)),
                                                               "dataset.json": b'{"classes": {}}'}),
                         "--dest", t / "o.zip"], ["--source", "no 'labels' key"], None),
    "convert: label a float": (
        lambda t, s, c: ["convert", "--source", labeled_source(t, b"1.5"), "--dest", t / "o.zip"],
        ["--source", "non-negative integers", "1.5"], None),
    "convert: label a string": (
        lambda t, s, c: ["convert", "--source", labeled_source(t, b'"3"'), "--dest", t / "o.zip"],
        ["--source", "non-negative integers", '"3"'], None),
    "convert: label negative": (
        lambda t, s, c: ["convert", "--source", labeled_source(t, b"-2"), "--dest", t / "o.zip"],
        ["--source", "non-negative integers", "-2"], None),
    "convert: image without label": (
        lambda t, s, c: ["convert", "--source", write_members(t / "l", {
            "a.png": png_file(np.zeros((8, 8, 3), np.uint8)), "b.png": png_file(np.zeros((8, 8, 3), np.uint8)),
            "dataset.json": b'{"labels": [["a.png", 0]]}'}), "--dest", t / "o.zip"],
        ["--source", "no label for b.png"], None),
    "convert: channels 2": (
        lambda t, s, c: ["convert", "--source", c, "--dest", t / "o.zip", "--channels", 2],
        ["--channels", "'2' is not one of 'auto', '1', '3'"], None),
    "convert: dest exists": (
        lambda t, s, c: ["convert", "--source", c, "--dest", a_file(t), "--resolution", 8], ["--dest", "already exists"],
        None),
    "convert: dest under a file": (
        lambda t, s, c: ["convert", "--source", c, "--dest", a_file(t) / "o.zip", "--resolution", 8],
        ["--dest", "is a file, not a folder"], None),
    "convert: under torchrun": (
        lambda t, s, c: ["convert", "--source", c, "--dest", t / "o.zip", "--resolution", 8],
        ["one process", "not torchrun"], TORCHRUN),
    "encode: dest exists": (
        lambda t, s, c: ["encode", "--source", s[0] / "toy.zip", "--dest", a_file(t)], ["--dest", "already exists"],
        None),
    "encode: dest under a file": (
        lambda t, s, c: ["encode", "--source", s[0] / "toy.zip", "--dest", a_file(t) / "e.zip", "--vae", s[1]],
        ["--dest", "is a file, not a folder"], None),
    "encode: VAE that cannot load": (
        lambda t, s, c: ["encode", "--source", s[0] / "toy.zip", "--dest", t / "e.zip", "--vae", t / "no-vae"],
        ["--vae", "no-vae"], None),
    "encode: VAE folder without weights": (
        lambda t, s, c: ["encode", "--source", s[0] / "toy.zip", "--dest", t / "e.zip", "--vae", c],
        ["--vae", "cannot load the VAE"], None),
    "encode: latent source": (
        lambda t, s, c: ["encode", "--source", s[2], "--dest", t / "e.zip", "--vae", s[1]], ["--source", ".png"], None),
    "encode: grayscale source": (
        lambda t, s, c: ["encode", "--source", grayscale_dataset(t), "--dest", t / "e.zip", "--vae", s[1]],
        ["--source", "1-channel", "RGB"], None),
    "encode: raw image folder": (
        lambda t, s, c: ["encode", "--source", c, "--dest", t / "e.zip", "--vae", s[1]],
        ["--source", "dataset_tool.py convert"], None),
    "encode: batch 0": (
        lambda t, s, c: ["encode", "--source", s[0] / "toy.zip", "--dest", t / "e.zip", "--batch", 0], ["--batch"],
        None),
    "encode: progress folder of something else": (
        lambda t, s, c: ["encode", "--source", s[0] / "toy.zip", "--dest", not_an_encode(t), "--vae", s[1]],
        ["e.zip.partial", "not an unfinished encode"], None),
    "encode: progress manifest nested 100,000 lists deep": (
        lambda t, s, c: ["encode", "--source", s[0] / "toy.zip", "--vae", s[1],
                         "--dest", not_an_encode(t, "[" * 100_000 + "]" * 100_000)],
        ["e.zip.partial", "not an unfinished encode", "nested 100000 levels"], None),
    "decode: PNG source": (
        lambda t, s, c: ["decode", "--source", s[0] / "toy.zip", "--dest", t / "d.zip"], ["--source", ".npy"], None),
    "decode: odd channel count": (
        lambda t, s, c: ["decode", "--source", three_channel_latents(t), "--dest", t / "d.zip", "--vae", s[1]],
        ["--source", "3 channels", "even"], None),
    "decode: VAE that cannot load": (
        lambda t, s, c: ["decode", "--source", s[2], "--dest", t / "d.zip", "--vae", t / "no-vae"],
        ["--vae", "no-vae"], None),
    "decode: dest under a file": (
        lambda t, s, c: ["decode", "--source", s[2], "--dest", a_file(t) / "d.zip", "--vae", s[1]],
        ["--dest", "is a file, not a folder"], None),
    "decode: under torchrun": (
        lambda t, s, c: ["decode", "--source", s[2], "--dest", t / "d.zip", "--vae", s[1]], ["not torchrun"], TORCHRUN),
    "toy: dest exists": (lambda t, s, c: ["toy", "--dest", a_file(t)], ["--dest", "already exists"], None),
    "toy: dest under a file": (
        lambda t, s, c: ["toy", "--dest", a_file(t) / "t.zip", "--num", 4], ["--dest", "is a file, not a folder"], None),
    "toy: too many classes": (lambda t, s, c: ["toy", "--dest", t / "t.zip", "--classes", 99], ["--classes", "99"], None),
    "toy: resolution 4": (lambda t, s, c: ["toy", "--dest", t / "t.zip", "--resolution", 4], ["--resolution"], None),
    "toy: num 0": (lambda t, s, c: ["toy", "--dest", t / "t.zip", "--num", 0], ["--num"], None),
    "toy: under torchrun": (lambda t, s, c: ["toy", "--dest", t / "t.zip", "--num", 4], ["not torchrun"], TORCHRUN),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_gives_one_line_and_writes_nothing(tmp_path, class_folders, encode_setup, case):
    build, words, env = BAD_INPUT[case]
    args = build(tmp_path, encode_setup, class_folders)
    assert_refused(tmp_path, lambda: run(*args, env=env), *words)


# ----------------------------------------------------------------------------------------------
# A read-only filesystem and a full disk, for real: tmpfs mounts in a private mount namespace.

FAULT_RUNNER = """
import json, os, sys
from click.testing import CliRunner
import dataset_tool
results = {}
for name, (args, mount) in json.loads(sys.argv[1]).items():
    result = CliRunner().invoke(dataset_tool.main, args)
    left = sorted(os.path.relpath(os.path.join(root, entry), mount)
                  for root, folders, names in os.walk(mount) for entry in folders + names)
    results[name] = dict(code=result.exit_code, output=result.output, left=left,
                         clean_exit=isinstance(result.exception, SystemExit))
print(json.dumps(results))
"""
# (command, its arguments after --dest, the --dest name, the mount); s = the encode setup, c = class folders.
FAULTS = {
    "convert on a read-only filesystem": ("convert", lambda s, c: ["--source", c, "--resolution", 8], "o.zip", "ro"),
    "encode on a read-only filesystem": ("encode", lambda s, c: ["--source", s[0] / "toy.zip", "--vae", s[1]],
                                         "e.zip", "ro"),
    "decode on a read-only filesystem": ("decode", lambda s, c: ["--source", s[2], "--vae", s[1]], "d", "ro"),
    "toy on a read-only filesystem": ("toy", lambda s, c: ["--num", 4], "t.zip", "ro"),
    "convert to a full disk": ("convert", lambda s, c: ["--source", c, "--resolution", 64, "--transform",
                                                        "center-crop", "--workers", 0], "o.zip", "full1"),
    "decode to a full disk": ("decode", lambda s, c: ["--source", s[2], "--vae", s[1]], "d.zip", "full2"),
    "toy ZIP to a full disk": ("toy", lambda s, c: ["--num", 200, "--resolution", 16], "t.zip", "full3"),
    "toy folder to a full disk": ("toy", lambda s, c: ["--num", 200, "--resolution", 16], "t", "full4"),
    "encode to a full disk": ("encode", lambda s, c: ["--source", s[0] / "toy.zip", "--vae", s[1], "--workers", 0],
                              "e.zip", "full5"),
}


@pytest.fixture(scope="module")
def fault_results(tmp_path_factory, encode_setup):
    """Every FAULTS case run once in one process that sees a read-only tmpfs and 4 KiB tmpfs mounts."""
    if subprocess.run(["which", "unshare"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare to mount a read-only or full filesystem")
    root = tmp_path_factory.mktemp("faults")
    classes = root / "train"
    for name, width, height in SOURCE_FILES:
        save_image(classes / name, np.full((height, width, 3), CLASS_COLOURS[name.split("/")[0]], np.uint8))
    mounts = {mount for *_, mount in FAULTS.values()}
    for mount in mounts:
        (root / mount).mkdir()
    cases = {name: ([command, "--dest", str(root / mount / dest)] + [str(a) for a in args(encode_setup, classes)],
                    str(root / mount)) for name, (command, args, dest, mount) in FAULTS.items()}
    # One tmpfs page, which the output of each full-disk case outgrows; the encode's has a second, so that its
    # manifest fits beside the name in its --dest's lock file and a latent is what fills the disk.
    sizes = {"ro": "ro", "full5": "size=8k"}
    script = " && ".join(f"mount -t tmpfs -o {sizes.get(m, 'size=4k')} tmpfs {root / m}" for m in mounts)
    result = subprocess.run(["unshare", "-rm", "sh", "-c", f'{script} && {sys.executable} -c "$0" "$1"',
                             FAULT_RUNNER, json.dumps(cases)], cwd=REPO, capture_output=True, text=True, timeout=300)
    if "mount" in result.stderr and result.returncode != 0:
        pytest.skip(f"cannot mount here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.bad_input
@pytest.mark.parametrize("case", [name for name in FAULTS if name != "encode to a full disk"])
def test_read_only_or_full_disk_gives_one_line_and_leaves_nothing(fault_results, case):
    outcome = fault_results[case]
    assert outcome["clean_exit"], outcome["output"]
    # A read-only filesystem is found before any work, in --dest's folder; a full disk while writing --dest.
    words = ["--dest", "/ro: cannot write", "Read-only file system"] if FAULTS[case][3] == "ro" else [
        FAULTS[case][2], "No space left on device"]
    assert_one_error_line(subprocess.CompletedProcess([], outcome["code"], outcome["output"], ""), *words)
    assert outcome["left"] == []


def test_encode_to_a_full_disk_keeps_only_finished_progress(fault_results):
    outcome = fault_results["encode to a full disk"]
    assert outcome["clean_exit"], outcome["output"]
    assert_one_error_line(subprocess.CompletedProcess([], outcome["code"], outcome["output"], ""),
                          "e.zip.partial", "No space left on device")
    # The progress folder is what a rerun continues from: its manifest and whole latents, no temporaries.
    assert outcome["left"] and all(entry.startswith("e.zip.partial") for entry in outcome["left"])
    assert "e.zip.partial/encode.json" in outcome["left"]
    assert not [entry for entry in outcome["left"] if entry.endswith(".tmp")]


# ----------------------------------------------------------------------------------------------
# What killed runs left: a rerun removes its own stale temporaries, and nothing of a live writer's.

STALE_CASES = {
    "toy ZIP": lambda t, s, c: ["toy", "--num", 4, "--resolution", 8, "--dest", t / "out.zip"],
    "toy folder": lambda t, s, c: ["toy", "--num", 4, "--resolution", 8, "--dest", t / "out"],
    "convert": lambda t, s, c: ["convert", "--source", c, "--resolution", 8, "--transform", "center-crop",
                                "--workers", 0, "--dest", t / "out.zip"],
    "encode": lambda t, s, c: ["encode", "--source", s[0] / "toy.zip", "--vae", s[1], "--workers", 0,
                               "--dest", t / "out.zip"],
    "decode": lambda t, s, c: ["decode", "--source", s[2], "--vae", s[1], "--max-images", 2, "--dest", t / "out"],
}


@pytest.mark.parametrize("case", STALE_CASES)
def test_a_rerun_removes_the_stale_temporary_files_of_its_dest(tmp_path, class_folders, encode_setup, case):
    args = STALE_CASES[case](tmp_path, encode_setup, class_folders)
    dest = args[-1]
    host = socket.gethostname()
    stale_file = tmp_path / files.temporary_name(dest.name, f".{dest.name}.{dead_pid()}@{host}.")
    stale_file.write_bytes(b"half a ZIP")
    # A folder is never removed by the clean-up (a user's may carry such a name): it is named, for the user.
    stale_folder = tmp_path / files.temporary_name(dest.name, f".{dest.name}.{dead_pid()}@{host}.")
    (stale_folder / "00000").mkdir(parents=True)
    (stale_folder / "00000" / "img00000000.png").write_bytes(b"half a dataset")
    live = tmp_path / files.temporary_name(dest.name)  # this process: a writer still running
    live.write_bytes(b"busy")
    other = tmp_path / files.temporary_name("other.zip", f".other.zip.{dead_pid()}@{host}.")  # not ours to remove
    other.write_bytes(b"?")
    result = run(*args)
    assert_ok(result)
    assert f"Left {stale_folder}" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([dest.name, live.name, other.name, stale_folder.name,
                                                                 "train"])
    ImageFolderDataset(dest)


@pytest.mark.bad_input
@pytest.mark.parametrize("case", STALE_CASES)
def test_a_second_writer_of_a_dest_is_refused(tmp_path, class_folders, encode_setup, case):
    # Two runs into one --dest both wrote it, the later replacing the other; now the later is refused at once.
    args = STALE_CASES[case](tmp_path, encode_setup, class_folders)
    dest = args[-1]
    first = DestinationLock(dest, "dataset_tool.py toy")
    first.acquire()
    try:
        assert_refused(tmp_path, lambda: run(*args),
                       f"{dest} is in use by the dataset_tool.py toy process {os.getpid()} on host")
    finally:
        first.release()


def test_a_killed_toy_run_leaves_a_temporary_folder_that_the_rerun_names_and_keeps(tmp_path):
    dest = tmp_path / "toy"
    command = [sys.executable, "dataset_tool.py", "toy", "--dest", str(dest), "--num", "1000000", "--resolution", "8"]
    child = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: list(tmp_path.glob(".toy.*.tmp/00000/img00000001.png")), child, timeout=300, poll_s=0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    [stale] = tmp_path.glob(".toy.*.tmp")
    result = run("toy", "--dest", dest, "--num", 3, "--resolution", 8)
    assert_ok(result)
    assert f"Left {stale}: a folder an interrupted dataset_tool.py may have written" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["toy", stale.name])
    assert len(ImageFolderDataset(dest)) == 3


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


def test_convert_scales_16_bit_grayscale_to_8_bits(tmp_path):
    values = np.array([[0, 128, 129, 32767], [32768, 65406, 65407, 65535]], np.uint16)  # round-half boundaries
    source = write_members(tmp_path / "src", {"a.png": png_file(np.tile(values, (2, 1)))})
    assert_ok(run("convert", "--source", source, "--dest", tmp_path / "o", "--workers", 0))
    image = ImageFolderDataset(tmp_path / "o")[0][0]
    # v * 255 / 65535 = v / 257, rounded to nearest: 128 -> 0.498, 129 -> 0.502, 32767 -> 127.498, 32768 -> 127.502.
    assert image.shape == (1, 4, 4) and PIL.Image.open(tmp_path / "src" / "a.png").mode == "I;16"
    assert image[0, :2].tolist() == [[0, 0, 1, 127], [128, 254, 255, 255]]


def test_names_with_control_characters_are_shown_escaped_and_forge_no_line(tmp_path):
    # Issue 26, item 8: a class folder named with a newline printed a forged 'Error:' line during convert.
    forged, bell = "Flags\nError: forged", "smile \U0001f600\r\x1b[2K"
    source = tmp_path / "source"
    save_image(source / forged / "a.png", np.zeros((8, 8, 3), np.uint8))
    save_image(source / bell / "b.png", np.zeros((8, 8, 3), np.uint8))
    (source / forged / "broken\n.png").write_bytes(b"\x89PNG broken")
    result = run("convert", "--source", source, "--dest", tmp_path / "out.zip", "--on-error=skip")
    assert_ok(result)
    lines = result.output.splitlines()
    assert not any(line.startswith("Error") for line in lines)
    assert "skipping Flags\\nError: forged/broken\\n.png: cannot read it" in result.output  # the skip line
    assert "  0: Flags\\nError: forged" in lines and "  1: smile \U0001f600\\r\\x1b[2K" in lines  # the label list
    save_image(source / forged / "wide.png", np.zeros((8, 12, 3), np.uint8))  # an error line naming the image
    refused = run("convert", "--source", source, "--dest", tmp_path / "out2.zip", "--on-error=skip")
    assert refused.exit_code != 0 and not (tmp_path / "out2.zip").exists()
    [line] = [line for line in refused.output.splitlines() if line.startswith("Error")]
    assert line.startswith("Error: Flags\\nError: forged/wide.png is 12x8")


# ----------------------------------------------------------------------------------------------
# Transparency (issue 26, item 8: 921 of 1,906 emoji came out on black or smeared backgrounds, silently).

def rgba_source(tmp_path):
    """Three 8x8 images: RGBA with a clear left half hiding black and a half-clear (alpha 128) blue right half, an
    opaque RGBA, and an RGB one."""
    source = tmp_path / "emoji"
    clear = np.zeros((8, 8, 4), np.uint8)
    clear[:, 4:] = (0, 0, 255, 128)
    save_image(source / "a.png", clear)
    save_image(source / "b.png", np.full((8, 8, 4), (10, 200, 30, 255), np.uint8))
    save_image(source / "c.png", np.full((8, 8, 3), (90, 90, 90), np.uint8))
    return source


def converted(path):
    return [np.asarray(PIL.Image.open(p)) for p in sorted(path.rglob("img*.png"))]


def test_convert_reports_transparency_and_drops_keeps_or_composites_it(tmp_path):
    source = rgba_source(tmp_path)
    dropped = run("convert", "--source", source, "--dest", tmp_path / "drop")
    assert_ok(dropped)
    assert "1 of 3 images had transparent pixels: their alpha was dropped" in dropped.output
    assert "wrote 3 RGB images" in dropped.output and converted(tmp_path / "drop")[0][0, 0].tolist() == [0, 0, 0]

    kept = run("convert", "--source", source, "--dest", tmp_path / "keep", "--alpha=keep")
    assert_ok(kept)
    assert "wrote 3 RGBA (4 channels) images" in kept.output and "1 of 3 images had transparent pixels" in kept.output
    first, second, third = converted(tmp_path / "keep")
    assert first[0, 0].tolist() == [0, 0, 0, 0] and first[0, 7].tolist() == [0, 0, 255, 128]
    assert second[0, 0].tolist() == [10, 200, 30, 255] and third[0, 0].tolist() == [90, 90, 90, 255]
    assert ImageFolderDataset(tmp_path / "keep").num_channels == 4

    composite = run("convert", "--source", source, "--dest", tmp_path / "red", "--alpha=composite",
                    "--background=#ff0000")
    assert_ok(composite)
    assert "1 of 3 images had transparent pixels: composited onto #ff0000" in composite.output
    first, second, _ = converted(tmp_path / "red")
    assert first[0, 0].tolist() == [255, 0, 0] and second[0, 0].tolist() == [10, 200, 30]
    # Over an opaque background: out = c a + bg (1 - a), a = 128/255; 8-bit rounding within one level.
    expected = np.array([0, 0, 255]) * 128 / 255 + np.array([255, 0, 0]) * 127 / 255
    assert np.abs(first[0, 7] - expected).max() <= 1


@pytest.mark.parametrize("alpha", ["drop", "composite", "keep"])
def test_palette_images_with_transparency_convert_without_pil_warnings(tmp_path, alpha):
    # A palette PNG whose tRNS gives entry 1 alpha 0 and entry 2 alpha 128 (PIL keeps such a tRNS as bytes): PIL
    # warns converting it to RGB or L directly, once per image; the colours are its palette's all the same.
    index = np.zeros((8, 8), np.uint8)
    index[:, 4:6], index[:, 6:] = 1, 2
    image = PIL.Image.fromarray(index, "P")
    image.putpalette([200, 10, 10, 0, 0, 250, 0, 250, 0] + [0] * 759)
    (tmp_path / "icons").mkdir()
    image.save(tmp_path / "icons" / "a.png", transparency=bytes([255, 0, 128]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = run("convert", "--source", tmp_path / "icons", "--dest", tmp_path / "out", f"--alpha={alpha}",
                     "--workers=0")  # in this process, where the warnings filter applies
    assert_ok(result)
    assert "1 of 1 images had transparent pixels" in result.output
    [out] = converted(tmp_path / "out")
    clear = {"drop": [0, 0, 250], "composite": [255, 255, 255], "keep": [0, 0, 250, 0]}[alpha]
    assert out[0, 0].tolist() == [200, 10, 10, 255][:len(clear)] and out[0, 4].tolist() == clear
    # Half-clear green: kept, dropped to its colour, or over white as c a + 255 (1 - a), a = 128/255, within a level.
    half = {"drop": [0, 250, 0], "keep": [0, 250, 0, 128]}.get(alpha, np.array([0, 250, 0]) * 128 / 255 + 255 * 127 / 255)
    assert np.abs(out[0, 7] - np.asarray(half)).max() <= (1 if alpha == "composite" else 0)


def rgba_as(tmp_path, kind):
    """rgba_source's three images as a folder, a ZIP, or webdataset tar shards (two tars, classes 2, 0, 1)."""
    source = rgba_source(tmp_path)
    if kind == "zip":
        with zipfile.ZipFile(tmp_path / "emoji.zip", "w") as archive:
            for path in sorted(source.iterdir()):
                archive.write(path, path.name)
        return tmp_path / "emoji.zip"
    if kind == "tar":
        import webdataset as wds

        (tmp_path / "tars").mkdir()
        for t, names in enumerate([["a.png", "b.png"], ["c.png"]]):
            with wds.TarWriter(str(tmp_path / "tars" / f"{t:05d}.tar")) as writer:
                for name in names:
                    label = {"a.png": 2, "b.png": 0, "c.png": 1}[name]
                    writer.write({"__key__": name[0], "png": (source / name).read_bytes(), "cls": str(label).encode()})
        return tmp_path / "tars"
    return source


# What each --alpha makes of rgba_source's first image at (0, 0) (clear, hiding black) and (0, 7) (blue at alpha
# 128, over white c a + 255 (1 - a) with a = 128/255), and of its opaque second image.
ALPHA_PIXELS = {"drop": ([0, 0, 0], [0, 0, 255], [10, 200, 30]),
                "keep": ([0, 0, 0, 0], [0, 0, 255, 128], [10, 200, 30, 255]),
                "composite": ([255, 255, 255], [127, 127, 255], [10, 200, 30])}


@pytest.mark.parametrize("dest", ["out.zip", "out", "out.shards"])
@pytest.mark.parametrize("kind", ["folder", "zip", "tar"])
@pytest.mark.parametrize("alpha", list(ALPHA_PIXELS))
def test_every_source_converts_with_every_alpha_mode(tmp_path, kind, dest, alpha):
    source = rgba_as(tmp_path, kind)
    result = run("convert", "--source", source, "--dest", tmp_path / dest, f"--alpha={alpha}", "--workers=0")
    assert_ok(result)
    assert "1 of 3 images had transparent pixels" in result.output
    dataset = ShardDataset(tmp_path / dest) if dest.endswith(".shards") else ImageFolderDataset(tmp_path / dest)
    first, second = (dataset[i][0].transpose(1, 2, 0) for i in range(2))
    clear, half, opaque = ALPHA_PIXELS[alpha]
    assert first[0, 0].tolist() == clear and second[0, 0].tolist() == opaque
    assert np.abs(first[0, 7].astype(int) - half).max() <= (1 if alpha == "composite" else 0)  # 8-bit rounding
    if kind == "tar":
        assert [int(dataset.raw_labels[i]) for i in range(3)] == [2, 0, 1]


@pytest.mark.parametrize("kind", ["folder", "zip"])
def test_images_convert_into_shards_as_into_a_zip_with_a_label_map_and_a_transform(tmp_path, kind):
    source, rng = tmp_path / "pets", np.random.default_rng(0)
    for i, (folder, width) in enumerate([("cats", 12), ("dogs", 10), ("cats", 9)]):
        save_image(source / folder / f"{i}.png", rng.integers(0, 256, (width + 2, width, 4), np.uint8))
    if kind == "zip":
        with zipfile.ZipFile(tmp_path / "pets.zip", "w") as archive:
            for path in sorted(source.rglob("*.png")):
                archive.write(path, path.relative_to(source).as_posix())
        source = tmp_path / "pets.zip"
    (tmp_path / "map.json").write_text(json.dumps({"cats": 3, "dogs": 1}))
    options = ["--source", source, "--labels", tmp_path / "map.json", "--resolution=6", "--transform=center-crop",
               "--alpha=composite", "--background=#102030", "--workers=0"]
    # Into shards in two reading processes, as the same images into a ZIP in this one.
    results = [run("convert", *options, "--dest", tmp_path / "out.zip"),
               run("convert", *options, "--workers=2", "--dest", tmp_path / "out.shards")]
    for result in results:
        assert_ok(result)
        assert "3 of 3 images had transparent pixels: composited onto #102030" in result.output
    zipped, sharded = ImageFolderDataset(tmp_path / "out.zip"), ShardDataset(tmp_path / "out.shards")
    assert len(sharded) == 3 and sharded.image_shape == [3, 6, 6]
    assert all(np.array_equal(sharded[i][0], zipped[i][0]) for i in range(3))
    # Sorted: cats/0.png, cats/2.png, dogs/1.png, numbered by the map.
    assert [int(sharded.raw_labels[i]) for i in range(3)] == [int(zipped.raw_labels[i]) for i in range(3)] == [3, 3, 1]
    assert sharded.classes == zipped.classes == {"cats": 3, "dogs": 1}


@pytest.mark.parametrize("channels, shape", [("auto", [1, 4, 4]), ("3", [3, 4, 4])])
def test_grayscale_images_convert_into_shards_with_the_channels_of_a_zip(tmp_path, channels, shape):
    for i in range(2):
        save_image(tmp_path / "gray" / f"{i}.png", np.full((4, 4), 50 * i + 3, np.uint8))
    for dest in ("out.zip", "out.shards"):
        assert_ok(run("convert", "--source", tmp_path / "gray", "--dest", tmp_path / dest, f"--channels={channels}",
                      "--workers=0"))
    zipped, sharded = ImageFolderDataset(tmp_path / "out.zip"), ShardDataset(tmp_path / "out.shards")
    assert sharded.image_shape == zipped.image_shape == shape
    assert [sharded[i][0].tolist() for i in range(2)] == [np.full(shape, 50 * i + 3).tolist() for i in range(2)]


@pytest.mark.parametrize("dest", ["out.zip", "out.shards"])
def test_tar_shards_convert_at_a_given_resolution_and_transform(tmp_path, dest):
    source = rgba_as(tmp_path, "tar")
    assert_ok(run("convert", "--source", source, "--dest", tmp_path / dest, "--resolution=4", "--transform=center-crop",
                  "--alpha=composite", "--workers=0"))
    dataset = ShardDataset(tmp_path / dest) if dest.endswith(".shards") else ImageFolderDataset(tmp_path / dest)
    assert dataset.image_shape == [3, 4, 4] and len(dataset) == 3
    # LANCZOS from 8 to 4 of the second image, one colour throughout: that colour.
    assert dataset[1][0].reshape(3, -1).T.tolist() == [[10, 200, 30]] * 16


def named_class_tars(tmp_path, names=("places", "apps", "places")):
    """One tar of three 8x8 images whose KEY.cls are class names, as a tar of icon themes' folders would give."""
    import webdataset as wds

    (tmp_path / "named").mkdir()
    with wds.TarWriter(str(tmp_path / "named" / "00000.tar")) as writer:
        for i, name in enumerate(names):
            png = png_file(np.full((8, 8, 3), 40 * i, np.uint8))
            writer.write({"__key__": f"s{i}", "png": png, "cls": name.encode()})
    return tmp_path / "named"


@pytest.mark.parametrize("dest", ["out.zip", "out.shards"])
def test_tar_class_names_are_numbered_by_a_label_map(tmp_path, dest):
    (tmp_path / "map.json").write_text(json.dumps({"apps": 4, "places": 1}))
    result = run("convert", "--source", named_class_tars(tmp_path), "--dest", tmp_path / dest, "--labels",
                 tmp_path / "map.json", "--workers=0")
    assert_ok(result)
    dataset = ShardDataset(tmp_path / dest) if dest.endswith(".shards") else ImageFolderDataset(tmp_path / dest)
    assert [int(dataset.raw_labels[i]) for i in range(3)] == [1, 4, 1]
    if dest == "out.zip":  # the names are kept beside the numbers, and printed
        assert dataset.classes == {"apps": 4, "places": 1} and "  4: apps" in result.output


@pytest.mark.bad_input
def test_a_tar_class_the_label_map_does_not_name_is_one_line(tmp_path):
    (tmp_path / "map.json").write_text(json.dumps({"apps": 0}))
    source = named_class_tars(tmp_path)
    assert_refused(tmp_path, lambda: run("convert", "--source", source, "--dest", tmp_path / "out.zip", "--labels",
                                         tmp_path / "map.json"), "00000.tar: sample s0 has class 'places'",
                   "the label map does not name")


@pytest.mark.bad_input
def test_tar_shards_are_rgb_whatever_channels_asks_in_one_line(tmp_path):
    source = rgba_as(tmp_path, "tar")
    assert_refused(tmp_path, lambda: run("convert", "--source", source, "--dest", tmp_path / "out.zip",
                                         "--channels=1"), "--channels", "is tar shards, whose images become RGB")


def test_kept_alpha_trains_and_draws_grids_as_a_fourth_channel(tmp_path):
    from edm2.encoders import StandardRGBEncoder
    from edm2.procedures.image_grid import save_png
    from tests.helpers import TRAIN_ARGS, tiny_precond
    from training.run.sample_grid import sample_grid
    import train_edm2

    source = rgba_source(tmp_path)
    assert_ok(run("convert", "--source", source, "--dest", tmp_path / "keep.zip", "--alpha=keep"))
    timed = CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, f"--data={tmp_path / 'keep.zip'}", "--cond=False",
                                                 "--batch=4", "--workers=0", f"--outdir={tmp_path / 'run'}",
                                                 "--dry-run", "--time-steps=1"])
    assert timed.exit_code == 0, timed.output
    assert json.loads(timed.stdout)["dataset"]["num_channels"] == 4 and "Timed 1 step(s)" in timed.stderr
    grid = sample_grid(tiny_precond(img_channels=4, label_dim=0), StandardRGBEncoder(), 2, 2, 2, torch.device("cpu"))
    save_png(tmp_path / "grid.png", grid)
    with PIL.Image.open(tmp_path / "grid.png") as image:
        assert image.mode == "RGBA" and image.size == (17, 17)


@pytest.mark.bad_input
@pytest.mark.parametrize("args, message", [
    (["--alpha=composite", "--background=teal"], "'teal' is no colour: use white, black or #rrggbb"),
    (["--background=black"], "is used by --alpha=composite only (--alpha=drop)"),
])
def test_bad_background_is_one_line(tmp_path, args, message):
    source = rgba_source(tmp_path)
    assert_refused(tmp_path, lambda: run("convert", "--source", source, "--dest", tmp_path / "out", *args),
                   "--background", message)


# ----------------------------------------------------------------------------------------------
# Class numbers kept for fine-tuning on a subset of the classes (issue 26, item 8).

def test_convert_keeps_a_given_label_map_and_records_the_class_names(tmp_path, class_folders):
    assert_ok(run("convert", "--source", class_folders, "--dest", tmp_path / "all.zip", "--resolution=8",
                  "--transform=center-crop"))
    assert ImageFolderDataset(tmp_path / "all.zip").classes == {"cat": 0, "dog": 1, "eel": 2}
    subset = tmp_path / "subset"
    subset.mkdir()
    for folder in ("eel", "dog"):
        os.symlink(class_folders / folder, subset / folder)
    # Alone, the two folders would become classes 0 and 1; the original dataset's map keeps them 1 and 2.
    result = run("convert", "--source", subset, "--dest", tmp_path / "sub.zip", "--resolution=8",
                 "--transform=center-crop", "--labels", tmp_path / "all.zip")
    assert_ok(result)
    assert "  1: dog" in result.output and "  2: eel" in result.output
    ds = ImageFolderDataset(tmp_path / "sub.zip")
    assert ds.raw_labels.tolist() == [1, 1, 2] and ds.classes == {"dog": 1, "eel": 2} and ds.label_dim == 3
    with zipfile.ZipFile(tmp_path / "sub.zip") as archive:  # the release's "labels" as they were, names beside
        stored = json.loads(archive.read("dataset.json"))
    assert stored["labels"] == [[image_fname(i), label] for i, label in enumerate([1, 1, 2])]
    (tmp_path / "map.json").write_text(json.dumps({"eel": 7, "dog": 0}))  # a plain map file
    assert_ok(run("convert", "--source", subset, "--dest", tmp_path / "map.zip", "--resolution=8",
                  "--transform=center-crop", "--labels", tmp_path / "map.json"))
    assert ImageFolderDataset(tmp_path / "map.zip").raw_labels.tolist() == [0, 0, 7]


@pytest.mark.bad_input
@pytest.mark.parametrize("label_map, message", [
    ({"cat": 0, "dog": 1}, "the label map gives no class to the folder eel (1 folder(s) unmapped)"),
    ({"cat": 0, "dog": 1, "eel": 1}, "gives class 1 two names"),
    ({"cat": 0, "dog": -1, "eel": 2}, "must map class names to classes"),
])
def test_a_label_map_that_does_not_fit_is_one_line(tmp_path, class_folders, label_map, message):
    (tmp_path / "map.json").write_text(json.dumps(label_map))
    assert_refused(tmp_path, lambda: run("convert", "--source", class_folders, "--dest", tmp_path / "out.zip",
                                         "--resolution=8", "--transform=center-crop", "--labels", tmp_path / "map.json"),
                   "--labels", message)
