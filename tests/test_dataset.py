"""ImageFolderDataset on hand-made release-format datasets, and the atomic dataset writer."""

import io
import json
import os
import pickle
import zipfile

import numpy as np
import PIL.Image
import pytest
import torch

from edm2.dataset import (DatasetError, ImageFolderDataset, dataset_writer, image_fname, latent_fname,
                          png_bytes)

# The release's file names (its dataset_tool.py): the folder is the first 5 digits of the 8-digit index.
INDICES = [3, 999, 1000, 2047]


def release_name(idx, latent=False):
    digits = f"{idx:08d}"
    return f"{digits[:5]}/img-mean-std-{digits}.npy" if latent else f"{digits[:5]}/img{digits}.png"


def encode_png(array):
    buffer = io.BytesIO()
    PIL.Image.fromarray(array).save(buffer, format="png")
    return buffer.getvalue()


def make_release_dataset(root, members, zip_name=None):
    """Write {name: bytes} as a directory, or as an uncompressed ZIP with zipfile directly."""
    if zip_name:
        path = root / zip_name
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
            for name, data in members.items():
                archive.writestr(name, data)
        return path
    for name, data in members.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@pytest.fixture
def rgb_members():
    rng = np.random.default_rng(0)
    images = {release_name(i): rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) for i in INDICES}
    labels = {name: label for name, label in zip(images, [2, 0, 4, 2])}
    members = {name: encode_png(image) for name, image in reversed(list(images.items()))}
    members["dataset.json"] = json.dumps({"labels": [[n, labels[n]] for n in reversed(list(labels))]}).encode()
    return images, labels, members


@pytest.mark.parametrize("as_zip", [False, True])
def test_reads_release_png_dataset(tmp_path, rgb_members, as_zip):
    images, labels, members = rgb_members
    path = make_release_dataset(tmp_path, members, "data.zip" if as_zip else None)
    ds = ImageFolderDataset(path)
    assert len(ds) == 4 and ds.image_shape == [3, 8, 8]
    assert (ds.resolution, ds.num_channels, ds.label_dim, ds.has_labels) == (8, 3, 5, True)
    assert ds.name == "data" if as_zip else ds.name == tmp_path.name
    assert ds.fnames == sorted(images)  # release order: sorted relative paths
    for i, name in enumerate(sorted(images)):
        image, label = ds[i]
        assert image.dtype == np.uint8 and np.array_equal(image, images[name].transpose(2, 0, 1))
        assert label.dtype == np.float32 and label.shape == (5,)
        assert np.array_equal(label, np.eye(5, dtype=np.float32)[labels[name]])


def test_reads_latent_npy_dataset(tmp_path):
    rng = np.random.default_rng(1)
    latents = {release_name(i, latent=True): rng.standard_normal((8, 4, 4)).astype(np.float32) for i in INDICES}
    members = {}
    for name, array in latents.items():
        buffer = io.BytesIO()
        np.save(buffer, array)
        members[name] = buffer.getvalue()
    ds = ImageFolderDataset(make_release_dataset(tmp_path, members, "latents.zip"), resolution=4)
    assert (len(ds), ds.num_channels, ds.resolution, ds.has_labels, ds.label_dim) == (4, 8, 4, False, 0)
    for i, name in enumerate(sorted(latents)):
        image, label = ds[i]
        assert image.dtype == np.float32 and np.array_equal(image, latents[name])
        assert label.shape == (0,) and label.dtype == np.float32


@pytest.mark.parametrize("labels_json", [None, {"labels": None}, "use_labels=False"])
def test_unlabeled(tmp_path, rgb_members, labels_json):
    _, _, members = rgb_members
    if labels_json is None:
        del members["dataset.json"]
    elif isinstance(labels_json, dict):
        members["dataset.json"] = json.dumps(labels_json).encode()
    ds = ImageFolderDataset(make_release_dataset(tmp_path, members), use_labels=labels_json != "use_labels=False")
    assert (ds.has_labels, ds.label_dim, ds.raw_labels) == (False, 0, None)
    assert ds[0][1].shape == (0,)


def test_max_size_is_a_fixed_subset_with_matching_labels(tmp_path, rgb_members):
    images, labels, members = rgb_members
    path = make_release_dataset(tmp_path, members)
    ds = ImageFolderDataset(path, max_size=2)
    assert len(ds) == 2 and ds.fnames == ImageFolderDataset(path, max_size=2).fnames
    assert set(ds.fnames) < set(images) and ds.fnames == sorted(ds.fnames)
    assert ds.label_dim == 5  # classes of the whole dataset, not of the subset
    for i, name in enumerate(ds.fnames):
        assert np.array_equal(ds[i][0], images[name].transpose(2, 0, 1)) and ds[i][1].argmax() == labels[name]


def broken_datasets(tmp_path):
    """(path, words the one-line error must contain) for each kind of bad dataset."""
    square = encode_png(np.zeros((8, 8, 3), np.uint8))
    cases = {"missing": (tmp_path / "nothing-here", ["no such"])}
    (tmp_path / "garbage.zip").write_bytes(b"this is not a zip file")
    cases["bad zip"] = (tmp_path / "garbage.zip", ["not a readable ZIP"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no images")
    cases["no images"] = (tmp_path / "empty", ["no .png or .npy"])
    wide = make_release_dataset(tmp_path, {"a.png": encode_png(np.zeros((8, 6, 3), np.uint8))}, "wide.zip")
    cases["not square"] = (wide, ["a.png", "square"])
    (tmp_path / "mixed").mkdir()
    make_release_dataset(tmp_path / "mixed", {"a.png": square, "b.npy": b""})
    cases["png and npy"] = (tmp_path / "mixed", ["mixes"])
    (tmp_path / "unlisted").mkdir()
    labels = json.dumps({"labels": [["a.png", 0]]}).encode()
    make_release_dataset(tmp_path / "unlisted", {"a.png": square, "b.png": square, "dataset.json": labels})
    cases["unlabeled file"] = (tmp_path / "unlisted", ["b.png", "dataset.json"])
    (tmp_path / "corrupt").mkdir()
    make_release_dataset(tmp_path / "corrupt", {"a.png": square[:30]})
    cases["corrupt png"] = (tmp_path / "corrupt", ["a.png", "cannot read"])
    return cases


def test_bad_datasets_raise_one_line_naming_the_path(tmp_path):
    for case, (path, words) in broken_datasets(tmp_path).items():
        with pytest.raises(DatasetError) as info:
            ImageFolderDataset(path)
        message = str(info.value)
        assert isinstance(info.value, ValueError) and "\n" not in message, case
        assert str(path) in message and all(word in message for word in words), (case, message)


def test_resolution_mismatch_and_mixed_resolutions(tmp_path):
    members = {"a.png": encode_png(np.zeros((8, 8, 3), np.uint8)), "b.png": encode_png(np.zeros((4, 4, 3), np.uint8))}
    path = make_release_dataset(tmp_path, members)
    with pytest.raises(DatasetError, match="expected resolution 16"):
        ImageFolderDataset(path, resolution=16)
    ds = ImageFolderDataset(path, resolution=8)
    assert ds[0][0].shape == (3, 8, 8)
    with pytest.raises(DatasetError, match=r"b\.png has shape 3x4x4 but the first image has 3x8x8"):
        ds[1]


def test_pickles_and_serves_dataloader_workers(tmp_path, rgb_members):
    images, _, members = rgb_members
    ds = ImageFolderDataset(make_release_dataset(tmp_path, members, "data.zip"))
    expected = [ds[i][0] for i in range(len(ds))]  # opens the ZIP in this process
    copy = pickle.loads(pickle.dumps(ds))
    assert all(np.array_equal(copy[i][0], expected[i]) for i in range(len(ds)))
    loader = torch.utils.data.DataLoader(ds, batch_size=1, num_workers=2)
    assert all(np.array_equal(batch[0][0].numpy(), expected[i]) for i, batch in enumerate(loader))


def test_release_file_names():
    for idx in [0, 7, 999, 1000, 123456, 99999999]:
        assert image_fname(idx) == release_name(idx) and latent_fname(idx) == release_name(idx, latent=True)


@pytest.mark.parametrize("dest_name", ["out.zip", "out"])
def test_writer_output_reads_back_and_zip_is_stored(tmp_path, dest_name):
    dest = tmp_path / dest_name
    images = [np.full((4, 4, 3), 10 * i, np.uint8) for i in range(3)]
    with dataset_writer(dest) as writer:
        for i, image in enumerate(images):
            writer.add(image_fname(i), png_bytes(image), label=i % 2)
    ds = ImageFolderDataset(dest)
    assert [ds[i][1].argmax() for i in range(3)] == [0, 1, 0]
    assert all(np.array_equal(ds[i][0], images[i].transpose(2, 0, 1)) for i in range(3))
    if dest_name.endswith(".zip"):
        with zipfile.ZipFile(dest) as archive:
            assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_STORED}
    assert [p.name for p in tmp_path.iterdir()] == [dest_name]
    umask = os.umask(0)
    os.umask(umask)
    assert dest.stat().st_mode & 0o777 == (0o666 if dest_name.endswith(".zip") else 0o777) & ~umask


@pytest.mark.parametrize("dest_name", ["out.zip", "out"])
def test_writer_leaves_nothing_on_failure_and_null_labels_unless_all(tmp_path, dest_name):
    with pytest.raises(RuntimeError):
        with dataset_writer(tmp_path / dest_name) as writer:
            writer.add(image_fname(0), png_bytes(np.zeros((4, 4, 3), np.uint8)))
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with dataset_writer(tmp_path / dest_name) as writer:
        writer.add(image_fname(0), png_bytes(np.zeros((4, 4, 3), np.uint8)), label=3)
        writer.add(image_fname(1), png_bytes(np.zeros((4, 4, 3), np.uint8)), label=None)
    assert not ImageFolderDataset(tmp_path / dest_name).has_labels
