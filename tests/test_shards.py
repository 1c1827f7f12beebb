"""Shard datasets: convert writes them (resumably) from a ZIP or webdataset tar shards, they read back what went in,
encode into latent shards resumes to identical files, and every bad shard or blend is one line."""

import io
import json
import os
import shutil

import numpy as np
import PIL.Image
import pytest
import torch
from click.testing import CliRunner

import train_edm2
from edm2.data import shard_writer
from edm2.data.blend import BlendDataset, BlendError, parse_blend, segments
from edm2.data.dataset import ImageFolderDataset
from edm2.data.shards import INDEX_FILE, ShardDataset, shard_name
from edm2.data.sources import open_data
from edm2.encoders import StabilityVAEEncoder
from training.data_order import run_batches
from tests.helpers import (TRAIN_ARGS, assert_ok, assert_one_error_line, assert_refused, run_dataset_tool as run,
                           save_tiny_vae, write_image_dataset)




def files_of(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def write_tars(root, counts=(5, 4), size=(20, 24), leave_out=None):
    """Webdataset tar shards (img2dataset's layout) of random PNGs with a class each; leave_out=(tar, i, key)
    drops one member."""
    import webdataset as wds

    root.mkdir(parents=True, exist_ok=True)
    for t, count in enumerate(counts):
        with wds.TarWriter(str(root / f"{t:05d}.tar")) as writer:
            for i in range(count):
                buffer = io.BytesIO()
                pixels = np.random.default_rng([t, i]).integers(0, 256, (*size, 3), dtype=np.uint8)
                PIL.Image.fromarray(pixels).save(buffer, format="png")
                sample = {"__key__": f"{t}{i:04d}", "png": buffer.getvalue(), "cls": str((t + i) % 3).encode()}
                if leave_out is not None and leave_out[:2] == (t, i):
                    del sample[leave_out[2]]
                writer.write(sample)
    return root


@pytest.fixture(scope="module")
def zip_shards(tmp_path_factory):
    """A 10-image labeled ZIP and its shards (3 per shard)."""
    root = tmp_path_factory.mktemp("shards")
    assert_ok(run("toy", "--dest", root / "toy.zip", "--resolution", 8, "--num", 10, "--classes", 4))
    assert_ok(run("convert", "--source", root / "toy.zip", "--dest", root / "toy.shards", "--shard-size", 3))
    return root


def test_convert_zip_to_shards_reads_back_every_image_and_label(zip_shards):
    source, shards = ImageFolderDataset(zip_shards / "toy.zip"), open_data(zip_shards / "toy.shards")
    assert isinstance(shards, ShardDataset) and len(shards) == 10
    index = json.loads((zip_shards / "toy.shards" / INDEX_FILE).read_text())
    assert (index["encoding"], index["dtype"], index["shape"], index["shard_size"]) == ("pixels", "uint8",
                                                                                        [3, 8, 8], 3)
    assert sorted(os.listdir(zip_shards / "toy.shards")) == [INDEX_FILE] + [shard_name(k) for k in range(4)]
    for i in range(10):
        image, label = shards[i]
        assert np.array_equal(image, source[i][0]) and np.array_equal(label, source[i][1])
        assert shards.raw_labels[i] == source.raw_labels[i]


def test_a_killed_convert_resumes_to_identical_shards(zip_shards, tmp_path, monkeypatch):
    dest, original, written = tmp_path / "again.shards", shard_writer.write_shard, []

    def killed_after_two(*args):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(args[2])
        original(*args)

    monkeypatch.setattr(shard_writer, "write_shard", killed_after_two)
    args = ["convert", "--source", zip_shards / "toy.zip", "--dest", dest, "--shard-size", 3]
    assert run(*args).exit_code != 0 and not dest.exists()
    monkeypatch.setattr(shard_writer, "write_shard", lambda *a: written.append(a[2]) or original(*a))
    result = run(*args)
    assert_ok(result)
    assert "2 of 4 shards already written" in result.output and written == [0, 1, 2, 3]  # none written twice
    assert files_of(dest) == files_of(zip_shards / "toy.shards")


# ----------------------------------------------------------------------------------------------
# Webdataset tar shards: convert and a killed encode into latent shards.

def test_tar_shards_convert_into_pixel_shards(tmp_path):
    tars = write_tars(tmp_path / "tars")
    assert_ok(run("convert", "--source", tars, "--dest", tmp_path / "t.shards", "--resolution", 16,
                  "--transform", "center-crop", "--shard-size", 4))
    shards = ShardDataset(tmp_path / "t.shards")
    assert len(shards) == 9 and shards.image_shape == [3, 16, 16] and shards.label_dim == 3
    assert [shards.raw_labels[i] for i in range(9)] == [(0 + i) % 3 for i in range(5)] + [(1 + i) % 3
                                                                                          for i in range(4)]


def test_a_killed_encode_from_tar_shards_reruns_to_identical_latent_shards(tmp_path, monkeypatch):
    tars, vae = write_tars(tmp_path / "tars", counts=(4, 3), size=(16, 16)), save_tiny_vae(tmp_path / "vae")
    args = ["--source", tars, "--vae", vae, "--batch", 2, "--shard-size", 3]
    assert_ok(run("encode", *args, "--dest", tmp_path / "whole.shards"))
    original, calls = StabilityVAEEncoder.encode_pixels, []

    def killed_at_the_fourth_batch(self, x):
        calls.append(len(x))
        if len(calls) == 5:  # the first call finds the latent shape; shard 0 is 2 calls, shard 1 two more
            raise KeyboardInterrupt
        return original(self, x)

    monkeypatch.setattr(StabilityVAEEncoder, "encode_pixels", killed_at_the_fourth_batch)
    dest = tmp_path / "resumed.shards"
    assert run("encode", *args, "--dest", dest).exit_code != 0
    assert sorted(p.name for p in (tmp_path / "resumed.shards.partial").glob("*.bin")) == [shard_name(0)]
    monkeypatch.setattr(StabilityVAEEncoder, "encode_pixels", original)
    result = run("encode", *args, "--dest", dest)
    assert_ok(result)
    assert "1 of 3 shards already written" in result.output
    assert files_of(dest) == files_of(tmp_path / "whole.shards")
    latents = ShardDataset(dest)
    assert latents.encoding == "stability-vae" and latents.image_shape == [8, 8, 8] and len(latents) == 7


@pytest.mark.bad_input
@pytest.mark.parametrize("leave_out, words", [((1, 2, "png"), ["sample 10002", "has no image"]),
                                              ((0, 3, "cls"), ["sample 00003", "has no class"])])
def test_a_tar_sample_without_its_image_or_class_is_one_line(tmp_path, leave_out, words):
    tars = write_tars(tmp_path / "tars", leave_out=leave_out)
    assert_refused(tmp_path, lambda: run("convert", "--source", tars, "--dest", tmp_path / "t.shards",
                                         "--resolution", 16, "--transform", "center-crop"), "--source", *words)


def test_tar_sources_without_the_webdataset_package_are_one_line(tmp_path, monkeypatch):
    tars = write_tars(tmp_path / "tars", counts=(1,))
    monkeypatch.setitem(__import__("sys").modules, "webdataset", None)  # import webdataset raises ImportError
    assert_refused(tmp_path, lambda: run("convert", "--source", tars, "--dest", tmp_path / "t.shards"),
                   "needs the webdataset package", "pip install")


# ----------------------------------------------------------------------------------------------
# Bad shards, indexes and blends: one line before any training step (train_edm2.py --dry-run reads the data).

def damaged(zip_shards, tmp_path, damage):
    copy = tmp_path / "d.shards"
    shutil.copytree(zip_shards / "toy.shards", copy)
    damage(copy)
    return copy


def edit_index(**changes):
    def edit(folder):
        index = json.loads((folder / INDEX_FILE).read_text())
        (folder / INDEX_FILE).write_text(json.dumps(dict(index, **changes)))
    return edit


def swap(folder):
    a, b = folder / shard_name(0), folder / shard_name(1)
    a.rename(folder / "x"), b.rename(a), (folder / "x").rename(b)


DAMAGES = {
    "missing shard": (lambda f: (f / shard_name(2)).unlink(), ["shard-000002.bin is missing"]),
    "truncated shard": (lambda f: os.truncate(f / shard_name(1), 100), ["shard-000001.bin holds 100 bytes",
                                                                       "truncated"]),
    "reordered shards": (swap, ["shard-000000.bin holds shard 1", "reordered"]),
    "index count disagrees": (edit_index(count=8), ["shard-000002.bin holds", "the index says", "disagrees"]),
    "index count short of the shards": (edit_index(count=9), ["shard-000003.bin", "beyond the index's 3",
                                                              "disagrees"]),
    "index of another dataset": (edit_index(id="0" * 32), ["not a shard of this dataset"]),
    "hostile count": (edit_index(count=1 << 40, shard_size=1), ["shards, more than"]),
    "hostile sample size": (edit_index(shape=[65536, 65536, 65536]), ["exceed"]),
    "hostile shard size": (edit_index(count=1 << 40, shard_size=1 << 40), ["holds 652 bytes, the index says"]),
    "wrong dtype": (edit_index(dtype="float32"), ["dtype 'float32' is not 'uint8'"]),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_bad_shards_are_one_line_before_training(zip_shards, tmp_path, case):
    damage, words = DAMAGES[case]
    data = damaged(zip_shards, tmp_path, damage)
    result = CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, f"--data={data}", f"--outdir={tmp_path / 'run'}",
                                                  "--dry-run"])
    assert_one_error_line(result, "--data", *words)
    assert not (tmp_path / "run").exists()


@pytest.mark.bad_input
@pytest.mark.parametrize("spec, words", [("A:0,B:0", ["sum to 0"]), ("A:-1,B:2", ["-1.0", "non-negative"]),
                                         ("A:nan", ["not a finite"]), ("A:1,B", ["not PATH:WEIGHT"]),
                                         ("A:1,L:1", ["mixed shapes or dtypes"])])
def test_bad_blends_are_one_line_before_training(zip_shards, tmp_path, spec, words):
    latents = tmp_path / "l.shards"
    index = shard_writer.new_index("stability-vae", [3, 8, 8], 4, 2, {}, 2)
    shard_writer.write_shards(latents, index, lambda k, first, n: (np.zeros((n, 3, 8, 8), np.float32),
                                                                   np.zeros(n, int)))
    spec = spec.replace("A", str(zip_shards / "toy.shards")).replace("B", str(zip_shards / "toy.zip"))
    result = CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, f"--data={spec.replace('L', str(latents))}",
                                                  f"--outdir={tmp_path / 'run'}", "--dry-run"])
    assert_one_error_line(result, "--data", *words)


def test_mixed_shapes_are_refused_when_written(tmp_path):
    index = shard_writer.new_index("pixels", [3, 8, 8], 0, 4, {}, 2)
    shard_writer.prepare(tmp_path / "m.shards", index)
    with pytest.raises(Exception, match="mixed shapes or dtypes"):
        shard_writer.write_shard(tmp_path / "m.shards", index, 0, np.zeros((2, 3, 8, 9), np.uint8), None)


@pytest.mark.bad_input
def test_images_of_mixed_sizes_into_shards_are_one_line_and_leave_nothing(tmp_path):
    source = tmp_path / "raw"
    source.mkdir()
    for name, size in [("a.png", 8), ("b.png", 8), ("c.png", 6)]:
        PIL.Image.fromarray(np.zeros((size, size, 3), np.uint8)).save(source / name)
    assert_refused(tmp_path, lambda: run("convert", "--source", source, "--dest", tmp_path / "m.shards",
                                         "--workers=0"), "c.png is 6x6 but earlier images are 8x8")


@pytest.mark.bad_input
def test_a_dataset_of_mixed_channels_into_shards_is_one_line_and_leaves_nothing(tmp_path):
    folder = write_image_dataset(tmp_path / "img", num=4, labels=False)
    PIL.Image.fromarray(np.zeros((8, 8), np.uint8), "L").save(folder / "00000" / "img00000002.png")
    assert_refused(tmp_path, lambda: run("convert", "--source", folder, "--dest", tmp_path / "m.shards"),
                   "img00000002.png", "mixed channel counts")


@pytest.mark.bad_input
def test_a_dataset_of_mixed_channels_encoded_into_shards_is_one_line_and_leaves_nothing(tmp_path):
    folder = write_image_dataset(tmp_path / "img", num=4, resolution=16, labels=False)
    PIL.Image.fromarray(np.zeros((16, 16), np.uint8), "L").save(folder / "00000" / "img00000002.png")
    vae = save_tiny_vae(tmp_path / "vae")
    assert_refused(tmp_path, lambda: run("encode", "--source", folder, "--vae", vae, "--batch", 2,
                                         "--dest", tmp_path / "m.shards"), "img00000002.png", "mixed channel counts")


@pytest.mark.bad_input
def test_alpha_or_labels_of_a_dataset_into_shards_are_one_line(zip_shards, tmp_path):
    (tmp_path / "map.json").write_text(json.dumps({"a": 0}))
    for option in ["--alpha=keep", f"--labels={tmp_path / 'map.json'}"]:
        assert_refused(tmp_path, lambda: run("convert", "--source", zip_shards / "toy.zip", "--dest",
                                             tmp_path / "a.shards", option), "--dest",
                       "holds its samples and labels as they are")


def kill_at_the_second_shard(monkeypatch) -> object:
    """Make shard writes stop as Ctrl-C would at the second shard; returns the real write_shard to restore."""
    original = shard_writer.write_shard

    def killed_at_the_second(*a):
        if a[2] == 1:
            raise KeyboardInterrupt
        original(*a)

    monkeypatch.setattr(shard_writer, "write_shard", killed_at_the_second)
    return original


def test_a_killed_convert_of_images_keeps_its_progress_and_resumes_to_identical_shards(tmp_path, monkeypatch):
    source = tmp_path / "raw"
    for i, folder in enumerate(["x", "y", "x", "y"]):
        (source / folder).mkdir(parents=True, exist_ok=True)
        PIL.Image.fromarray(np.full((6, 6, 4), 60 * i, np.uint8)).save(source / folder / f"{i}.png")
    args = ["convert", "--source", source, "--alpha=keep", "--shard-size", 2, "--workers=0"]
    assert_ok(run(*args, "--dest", tmp_path / "whole.shards"))
    original = kill_at_the_second_shard(monkeypatch)
    dest = tmp_path / "resumed.shards"
    assert run(*args, "--dest", dest).exit_code != 0
    assert sorted(p.name for p in (tmp_path / "resumed.shards.partial").glob("*.bin")) == [shard_name(0)]
    monkeypatch.setattr(shard_writer, "write_shard", original)
    result = run(*args, "--dest", dest)
    assert_ok(result)
    assert "1 of 2 shards already written" in result.output
    assert files_of(dest) == files_of(tmp_path / "whole.shards")
    assert ShardDataset(dest).image_shape == [4, 6, 6]


@pytest.mark.bad_input
def test_a_killed_convert_of_images_resumed_with_another_background_is_one_line(tmp_path, monkeypatch):
    source = tmp_path / "raw"
    source.mkdir()
    for i in range(2):
        PIL.Image.fromarray(np.zeros((6, 6, 4), np.uint8)).save(source / f"{i}.png")
    args = ["convert", "--source", source, "--dest", tmp_path / "b.shards", "--alpha=composite", "--shard-size", 1,
            "--workers=0"]
    original = kill_at_the_second_shard(monkeypatch)
    assert run(*args, "--background=black").exit_code != 0
    assert (tmp_path / "b.shards.partial" / shard_name(0)).exists()
    monkeypatch.setattr(shard_writer, "write_shard", original)
    # The same pixels' shape, other pixels: the finished shard cannot be kept.
    assert_refused(tmp_path, lambda: run(*args, "--background=white"), "b.shards.partial",
                   "holds an unfinished write with other settings")


@pytest.mark.bad_input
def test_skipping_unreadable_images_into_shards_is_one_line(tmp_path):
    source = tmp_path / "raw"
    source.mkdir()
    PIL.Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(source / "a.png")
    assert_refused(tmp_path, lambda: run("convert", "--source", source, "--dest", tmp_path / "m.shards",
                                         "--on-error=skip"), "--on-error", "numbers its samples without gaps")


# ----------------------------------------------------------------------------------------------
# Blends: shares by weight, from a JSON spec or the option.

def test_blend_segments_are_the_weights_shares_by_largest_remainder():
    assert segments([10, 10], [3, 1]) == [15, 5]
    assert segments([7, 3, 1], [1, 1, 1]) == [4, 4, 3]  # 11/3 each: the remainders go to the first two
    assert sum(segments([5, 6, 7], [0.1, 0.25, 0.3])) == 18 and segments([4, 4], [0, 2]) == [0, 8]


def test_a_json_blend_spec_equals_the_option(zip_shards, tmp_path):
    spec = tmp_path / "blend.json"
    spec.write_text(json.dumps({"sources": [{"path": str(zip_shards / "toy.shards"), "weight": 3},
                                            {"path": str(zip_shards / "toy.zip"), "weight": 1}]}))
    option = f"{zip_shards / 'toy.shards'}:3,{zip_shards / 'toy.zip'}:1"
    assert parse_blend(str(spec)) == parse_blend(option)
    blend = open_data(option)
    assert isinstance(blend, BlendDataset) and len(blend) == 20 and blend.segments == [15, 5]
    assert "75.0% (15 of every 20 samples" in blend.shares()
    assert np.array_equal(blend[13][0], ImageFolderDataset(zip_shards / "toy.zip")[3][0])
    with pytest.raises(BlendError, match="sum to 0"):
        parse_blend(f"{zip_shards / 'toy.zip'}:0")


def test_write_image_dataset_and_shards_hold_the_same_labels(tmp_path):
    folder = write_image_dataset(tmp_path / "img")
    assert_ok(run("convert", "--source", folder, "--dest", tmp_path / "img.shards"))
    folder_data, shards = ImageFolderDataset(folder), ShardDataset(tmp_path / "img.shards")
    assert [shards.raw_labels[i] for i in range(len(shards))] == folder_data.raw_labels.tolist()


@pytest.mark.bad_input
def test_a_crop_of_a_dataset_source_is_one_line_not_ignored(zip_shards, tmp_path):
    assert_refused(tmp_path, lambda: run("convert", "--source", zip_shards / "toy.zip", "--dest", tmp_path / "c.shards",
                                         "--resolution", 4, "--transform", "center-crop"),
                   "--resolution/--transform crop tar shards")



def test_the_batches_of_a_blend_log_each_sources_share(zip_shards, capsys):
    blend = open_data(f"{zip_shards / 'toy.shards'}:3,{zip_shards / 'toy.zip'}:1")
    with run_batches(blend, seed=0, start_nimg=0, batch_gpu=4, workers=0, device=torch.device("cpu")) as batches:
        images, _ = next(batches)
    assert images.shape == (4, 3, 8, 8)
    shares = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Blend of 2 datasets"))
    assert "toy.shards: 75.0% (15 of every 20 samples" in shares and "toy.zip: 25.0% (5 of every 20" in shares
