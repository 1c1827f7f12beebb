"""Shards as a source wherever a dataset is read: convert from shards into shards (pixels or latents), the class
names of dataset.json kept in the shard index and read back where class names are used, and scripts that read
datasets (scripts/figure15.py) reading shards as they read ZIPs."""

import json
import shutil

import numpy as np
import pytest

from edm2.data import shard_writer
from edm2.data.convert import read_label_map
from edm2.data.dataset_files import DatasetError
from edm2.data.dataset_json import CLASSES_KEY, LABELS_FILE
from edm2.data.shard_convert import source_index
from edm2.data.shards import INDEX_FILE, ShardDataset, read_index
from edm2.data.sources import open_data
from edm2.encoders import StandardRGBEncoder
from edm2.formats.snapshot import save_network, snapshot_name
from scripts import figure15
from training.run.preflight import dataset_description
from tests.helpers import (assert_ok, assert_one_error_line, randomized, run_dataset_tool as run, tiny_precond,
                           write_image_dataset)

CLASSES = {"circle": 0, "square": 1, "triangle": 2, "star": 3}




@pytest.fixture(scope="module")
def named(tmp_path_factory):
    """A 10-image folder dataset in 4 named classes (dataset.json's CLASSES_KEY) and its shards (3 per shard)."""
    root = tmp_path_factory.mktemp("named")
    folder = write_image_dataset(root / "named", num=10, classes=4)
    record = json.loads((folder / LABELS_FILE).read_text())
    (folder / LABELS_FILE).write_text(json.dumps(dict(record, **{CLASSES_KEY: CLASSES})))
    assert_ok(run("convert", "--source", folder, "--dest", root / "named.shards", "--shard-size", 3))
    return root


def samples_of(dataset) -> tuple[list[np.ndarray], list[np.ndarray]]:
    items = [dataset[i] for i in range(len(dataset))]
    return [x for x, _ in items], [y for _, y in items]


def test_the_shard_index_keeps_the_class_names_and_reads_them_back(named):
    shards = named / "named.shards"
    assert json.loads((shards / INDEX_FILE).read_text())[CLASSES_KEY] == CLASSES
    assert open_data(shards).classes == CLASSES
    assert open_data(shards, use_labels=False).classes is None
    assert dataset_description(open_data(shards))["classes"] == CLASSES  # a run's options, then its snapshots
    assert read_label_map(shards) == CLASSES  # convert --labels=NAME.shards


def test_encode_s_latent_index_keeps_the_class_names_too(named):
    # convert and encode make their index with source_index: latents of a named dataset name their classes
    index = source_index(open_data(named / "named"), {"encoding": "stability-vae"}, [8, 1, 1], {"batch": 8})
    assert (index["encoding"], index[CLASSES_KEY]) == ("stability-vae", CLASSES)


def test_an_index_without_class_names_reads_as_before_and_ids_stay(tmp_path):
    index = shard_writer.new_index("pixels", [3, 8, 8], 2, 4, {"source": "x"}, 2)
    assert CLASSES_KEY not in index
    assert index == shard_writer.new_index("pixels", [3, 8, 8], 2, 4, {"source": "x"}, 2, classes=None)
    named = shard_writer.new_index("pixels", [3, 8, 8], 2, 4, {"source": "x"}, 2, classes={"a": 0, "b": 1})
    assert named[CLASSES_KEY] == {"a": 0, "b": 1} and named["id"] != index["id"]
    shard_writer.write_shards(tmp_path / "d.shards", index, lambda k, first, n: (np.zeros((n, 3, 8, 8), np.uint8),
                                                                                  np.zeros(n, int)))
    assert ShardDataset(tmp_path / "d.shards").classes is None
    with pytest.raises(DatasetError, match="holds no class names"):
        read_label_map(tmp_path / "d.shards")


@pytest.mark.bad_input
def test_class_names_in_an_index_are_checked_as_dataset_json_s(named, tmp_path):
    shards = shutil.copytree(named / "named.shards", tmp_path / "d.shards")
    index = read_index(shards)
    for classes, words in [({"a": 0, "b": 0}, "gives class 0 two names"), ({"a": -1}, "must map class names"),
                           ([0, 1], "must map class names")]:
        (shards / INDEX_FILE).write_text(json.dumps(dict(index, **{CLASSES_KEY: classes})))
        with pytest.raises(DatasetError, match=f"{INDEX_FILE}: {CLASSES_KEY} {words}"):
            ShardDataset(shards)
    with pytest.raises(DatasetError, match="gives class 0 two names"):  # nor are they written
        shard_writer.write_shards(tmp_path / "e.shards", dict(index, **{CLASSES_KEY: {"a": 0, "b": 0}}),
                                  lambda k, first, n: (np.zeros((n, 3, 8, 8), np.uint8), np.zeros(n, int)))


@pytest.mark.parametrize("encoding, dtype", [("pixels", np.uint8), ("stability-vae", np.float32)])
def test_shards_convert_into_shards_of_another_shard_size(named, tmp_path, encoding, dtype):
    source = tmp_path / "source.shards"
    index = shard_writer.new_index(encoding, [4, 8, 8], 3, 7, {"source": "test"}, 3, classes={"a": 0, "b": 1, "c": 2})
    rng = np.random.default_rng(0)
    shard_writer.write_shards(source, index, lambda k, first, n: ((rng.random((n, 4, 8, 8)) * 200).astype(dtype),
                                                                  np.arange(first, first + n) % 3))
    dest = tmp_path / "new.shards"
    result = run("convert", "--source", source, "--dest", dest, "--shard-size", 2, "--max-images", 5)
    assert_ok(result)
    assert f"wrote 5 {encoding} samples of shape 4x8x8" in result.output
    converted, original = ShardDataset(dest), ShardDataset(source)
    assert (converted.index["shard_size"], len(converted), converted.classes) == (2, 5, original.classes)
    images, labels = samples_of(converted)
    for i in range(5):
        assert images[i].dtype == dtype and np.array_equal(images[i], original[i][0])
        assert np.array_equal(labels[i], original[i][1])


@pytest.mark.bad_input
def test_shards_into_a_png_dataset_are_one_line(named, tmp_path):
    result = run("convert", "--source", named / "named.shards", "--dest", tmp_path / "out.zip")
    assert_one_error_line(result, "--source", "named.shards", "shard dataset", "--dest=NAME.shards")
    assert not (tmp_path / "out.zip").exists()


def test_figure15_reads_shards_as_it_reads_the_folder_they_came_from(named, tmp_path):
    runs = tmp_path / "run"
    runs.mkdir()
    save_network(runs / snapshot_name("network-snapshot", 256, 0.1), randomized(tiny_precond(label_dim=4)),
                 dict(nimg=256, ema_std=0.1, encoder=StandardRGBEncoder().config(), loss={"P_mean": -0.8, "P_std": 1.6}))
    records = [figure15.run_records(runs, str(named / data), 0.1, 4, 0) for data in ["named", "named.shards"]]
    assert records[0] == records[1] and records[0][0]["activations"]  # the same samples, whatever holds them
