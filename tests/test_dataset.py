"""ImageFolderDataset on hand-made release-format datasets, its one dataset.json reader, and the pointer
to `dataset_tool.py convert` for folders of raw images (also through train_edm2.py)."""

import io
import json
import math
import pickle
import zipfile

import numpy as np
import PIL.Image
import pytest
import torch
from click.testing import CliRunner

import dataset_tool
import train_edm2
from edm2.data.dataset import DatasetError, FileTree, ImageFolderDataset, image_fname, latent_fname
from edm2.data.dataset_json import read_labels
from edm2.data.dataset_files import MAX_IMAGE_PIXELS
from edm2.errors import EDM2Error
from tests.helpers import (TRAIN_ARGS, assert_one_error_line, assert_refused, black_png, png_bomb_zip, png_file,
                           run_python_script, run_training_process, write_image_dataset, write_members)

# The release's file names (its dataset_tool.py): the folder is the first 5 digits of the 8-digit index.
INDICES = [3, 999, 1000, 2047]


def release_name(idx, latent=False):
    digits = f"{idx:08d}"
    return f"{digits[:5]}/img-mean-std-{digits}.npy" if latent else f"{digits[:5]}/img{digits}.png"


@pytest.fixture
def rgb_members():
    rng = np.random.default_rng(0)
    images = {release_name(i): rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) for i in INDICES}
    labels = {name: label for name, label in zip(images, [2, 0, 4, 2])}
    members = {name: png_file(image) for name, image in reversed(list(images.items()))}
    members["dataset.json"] = json.dumps({"labels": [[n, labels[n]] for n in reversed(list(labels))]}).encode()
    return images, labels, members


@pytest.mark.parametrize("as_zip", [False, True])
def test_reads_release_png_dataset(tmp_path, rgb_members, as_zip):
    images, labels, members = rgb_members
    path = write_members(tmp_path, members, "data.zip" if as_zip else None)
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
    ds = ImageFolderDataset(write_members(tmp_path, members, "latents.zip"), resolution=4)
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
    ds = ImageFolderDataset(write_members(tmp_path, members), use_labels=labels_json != "use_labels=False")
    assert (ds.has_labels, ds.label_dim, ds.raw_labels) == (False, 0, None)
    assert ds[0][1].shape == (0,)


def test_max_size_is_a_fixed_subset_with_matching_labels(tmp_path, rgb_members):
    images, labels, members = rgb_members
    path = write_members(tmp_path, members)
    ds = ImageFolderDataset(path, max_size=2)
    assert len(ds) == 2 and ds.fnames == ImageFolderDataset(path, max_size=2).fnames
    assert set(ds.fnames) < set(images) and ds.fnames == sorted(ds.fnames)
    assert ds.label_dim == 5  # classes of the whole dataset, not of the subset
    for i, name in enumerate(ds.fnames):
        assert np.array_equal(ds[i][0], images[name].transpose(2, 0, 1)) and ds[i][1].argmax() == labels[name]


SQUARE = png_file(np.zeros((8, 8, 3), np.uint8))


def missing(tmp_path):
    return tmp_path / "nothing-here"


def bad_zip(tmp_path):
    (tmp_path / "garbage.zip").write_bytes(b"this is not a zip file")
    return tmp_path / "garbage.zip"


def no_images(tmp_path):
    return write_members(tmp_path / "empty", {"notes.txt": b"no images"})


def not_square(tmp_path):
    return write_members(tmp_path, {"a.png": png_file(np.zeros((8, 6, 3), np.uint8))}, "wide.zip")


def png_and_npy(tmp_path):
    return write_members(tmp_path / "mixed", {"a.png": SQUARE, "b.npy": b""})


def unlabeled_file(tmp_path):
    labels = json.dumps({"labels": [["a.png", 0]]}).encode()
    return write_members(tmp_path / "unlisted", {"a.png": SQUARE, "b.png": SQUARE, "dataset.json": labels})


def corrupt_png(tmp_path):
    return write_members(tmp_path / "corrupt", {"a.png": SQUARE[:30]})


# (builder, words the one-line error must contain, whether it points to dataset_tool.py convert)
BROKEN_DATASETS = {
    "missing": (missing, ["no such"], False),
    "bad zip": (bad_zip, ["not a readable ZIP"], False),
    "no images": (no_images, ["no .png or .npy"], False),
    "not square": (not_square, ["a.png", "square"], True),
    "png and npy": (png_and_npy, ["mixes"], True),
    "unlabeled file": (unlabeled_file, ["b.png", "dataset.json"], False),
    "corrupt png": (corrupt_png, ["a.png", "cannot read"], True),
}


@pytest.mark.parametrize("case", BROKEN_DATASETS)
def test_bad_datasets_raise_one_line_naming_the_path(tmp_path, case):
    build, words, hint = BROKEN_DATASETS[case]
    path = build(tmp_path)
    with pytest.raises(DatasetError) as info:
        ImageFolderDataset(path)
    message = str(info.value)
    assert isinstance(info.value, EDM2Error) and "\n" not in message
    assert str(path) in message and all(word in message for word in words), message
    assert ("dataset_tool.py convert" in message) == hint, message


# dataset.json variants beside two release-named images; each must be refused in one line naming the file.
BAD_LABELS = {
    "not JSON": (b'{"labels": [', ["not in the release format", "not valid JSON"]),
    "not UTF-8": (b"\xff\xfe\x00", ["not in the release format"]),
    "no labels key": (b'{"classes": []}', ["no 'labels' key"]),
    "a list": (b"[]", ["not in the release format"]),
    "labels a dict": (b'{"labels": {"00000/img00000000.png": 1}}', ["[name, class] pairs"]),
    "triples": (b'{"labels": [["00000/img00000000.png", 1, 2]]}', ["[name, class] pairs"]),
    "float label": (b"1.5", ["non-negative integers", "1.5"]),
    "string label": (b'"3"', ["non-negative integers", '"3"']),
    "bool label": (b"true", ["non-negative integers", "true"]),
    "negative label": (b"-1", ["non-negative integers", "-1"]),
    "null label": (b"null", ["non-negative integers", "null"]),
    # Hostile sizes: refused before a one-hot of that many classes, or a parse that recurses 100,000 times.
    "label 10**30": (b"1" + b"0" * 30, ["not in the release format", "more than 20 digits"]),
    "label 2**40": (str(2**40).encode(), ["integers below 1048576", str(2**40)]),
    "nested 100,000 deep": (b"[" * 100_000 + b"]" * 100_000, ["not in the release format", "nested 100000 levels"]),
}


def labels_file(text):
    """A dataset.json text; a bare JSON value is the label of the second image (the first has class 0)."""
    if text.startswith((b"{", b"[")) or not text.isascii():
        return text
    return b'{"labels": [["00000/img00000000.png", 0], ["00000/img00000001.png", ' + text + b"]]}"


@pytest.mark.parametrize("case", BAD_LABELS)
def test_one_dataset_json_reader_refuses_what_is_not_the_release_format(tmp_path, case):
    text, words = BAD_LABELS[case]
    members = {image_fname(0): SQUARE, image_fname(1): SQUARE, "dataset.json": labels_file(text)}
    path = write_members(tmp_path, members, "data.zip")
    with pytest.raises(DatasetError) as info:
        ImageFolderDataset(path)
    message = str(info.value)
    assert "\n" not in message and f"{path}: dataset.json" in message and "dataset_tool" not in message
    assert all(word in message for word in words), message
    with pytest.raises(DatasetError, match="dataset.json") as again:
        read_labels(FileTree(path), [image_fname(0), image_fname(1)])
    assert str(again.value) == message  # one reader: the same rule and message for every caller


def test_read_labels_gives_the_classes_in_the_order_asked(tmp_path):
    names = [image_fname(i) for i in range(3)]
    listed = {"labels": [[names[2], 7], [names[0], 0], [names[1], 3]]}
    labeled = write_members(tmp_path / "labeled", {"dataset.json": json.dumps(listed).encode()})
    assert read_labels(FileTree(labeled), names) == [0, 3, 7]
    assert read_labels(FileTree(labeled), names[::-1]) == [7, 3, 0]
    null = write_members(tmp_path / "null", {"dataset.json": b'{"labels": null}'})
    assert read_labels(FileTree(null), names) is None
    assert read_labels(FileTree(write_members(tmp_path / "none", {"x.txt": b""})), names) is None


def test_resolution_mismatch_and_mixed_resolutions(tmp_path):
    # Release-named images are checked lazily, one by one as they are read.
    members = {image_fname(0): png_file(np.zeros((8, 8, 3), np.uint8)),
               image_fname(1): png_file(np.zeros((4, 4, 3), np.uint8))}
    path = write_members(tmp_path, members)
    with pytest.raises(DatasetError, match="expected resolution 16"):
        ImageFolderDataset(path, resolution=16)
    ds = ImageFolderDataset(path, resolution=8)
    assert ds[0][0].shape == (3, 8, 8)
    with pytest.raises(DatasetError, match=r"img00000001\.png has shape 3x4x4 but the first image has 3x8x8") as info:
        ds[1]
    assert "dataset_tool" not in str(info.value)


# ----------------------------------------------------------------------------------------------
# Folders of raw images (no dataset.json, names not in the release layout) get a pointer to convert.

def rgb(size, value=0):
    height, width = (size, size) if isinstance(size, int) else size
    return png_file(np.full((height, width, 3), value, np.uint8))


def jpeg(size):
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.zeros((size, size, 3), np.uint8)).save(buffer, format="jpeg")
    return buffer.getvalue()


RAW_FOLDERS = {
    "jpegs in class folders": ({"cat/a.jpg": jpeg(16), "dog/b.jpg": jpeg(20)},
                               ["no .png or .npy images found", ".jpg"]),
    "pngs of several sizes in class folders": ({"cat/a.png": rgb(16), "cat/b.png": rgb(16), "dog/c.png": rgb(24)},
                                               ["dog/c.png is 24x24 but cat/a.png is 16x16"]),
    "pngs beside jpegs": ({"cat/a.png": rgb(16), "dog/b.JPEG": jpeg(16)}, [".jpeg images beside"]),
    "first image not square": ({"n01/x.png": rgb((16, 20))}, ["n01/x.png", "square"]),
}


@pytest.mark.parametrize("case", RAW_FOLDERS)
def test_a_raw_image_folder_points_to_dataset_tool_convert(tmp_path, case):
    members, words = RAW_FOLDERS[case]
    path = write_members(tmp_path / "train", members)
    with pytest.raises(DatasetError) as info:
        ImageFolderDataset(path)
    message = str(info.value)
    assert "\n" not in message and all(word in message for word in words), message
    assert f"python dataset_tool.py convert --source={path} --dest=" in message


def test_raw_images_of_one_size_open_and_a_later_odd_one_points_to_convert(tmp_path):
    # generate.py's outputs (flat, or in blocks of 1000 with --subdirs, and --grid's grid.png at the top)
    # are raw-named but usable as they are (a caller leaves grid.png out).
    flat = write_members(tmp_path / "flat", {"000000.png": rgb(8, 1), "000001.png": rgb(8, 2)})
    blocks = write_members(tmp_path / "blocks", {"000000/000000.png": rgb(8, 1), "001000/001000.png": rgb(8, 2),
                                                 "grid.png": rgb(16)})
    for path in [flat, blocks]:
        ds = ImageFolderDataset(path, use_labels=False)
        assert ds[0][0].max() == 1 and ds[1][0].max() == 2
    # Only the first image of each sub-folder is checked up front; a later one of another size fails when read.
    write_members(flat, {"000002.png": rgb(4)})
    ds = ImageFolderDataset(flat)
    with pytest.raises(DatasetError, match="mixed resolutions") as info:
        ds[2]
    assert f"dataset_tool.py convert --source={flat}" in str(info.value)


@pytest.mark.bad_input
@pytest.mark.parametrize("case", ["jpegs in class folders", "pngs of several sizes in class folders"])
def test_train_edm2_on_a_raw_image_folder_says_to_convert_it_first(tmp_path, case):
    path = write_members(tmp_path / "train", RAW_FOLDERS[case][0])
    args = ["--preset", "toy-small", "--data", str(path), "--outdir", str(tmp_path / "run")]
    assert_refused(tmp_path, lambda: CliRunner().invoke(train_edm2.main, args), "--data",
                   f"python dataset_tool.py convert --source={path}")
    assert not (tmp_path / "run").exists()


def test_pickles_and_serves_dataloader_workers(tmp_path, rgb_members):
    images, _, members = rgb_members
    ds = ImageFolderDataset(write_members(tmp_path, members, "data.zip"))
    expected = [ds[i][0] for i in range(len(ds))]  # opens the ZIP in this process
    copy = pickle.loads(pickle.dumps(ds))
    assert all(np.array_equal(copy[i][0], expected[i]) for i in range(len(ds)))
    loader = torch.utils.data.DataLoader(ds, batch_size=1, num_workers=2)
    assert all(np.array_equal(batch[0][0].numpy(), expected[i]) for i, batch in enumerate(loader))


def test_release_file_names():
    for idx in [0, 7, 999, 1000, 123456, 99999999]:
        assert image_fname(idx) == release_name(idx) and latent_fname(idx) == release_name(idx, latent=True)




def test_gray_and_colour_pngs_in_one_dataset_are_named_as_such(tmp_path):
    path = write_members(tmp_path / "d", {image_fname(0): png_file(np.zeros((8, 8), np.uint8)),
                                          image_fname(1): png_file(np.zeros((8, 8, 3), np.uint8)),
                                          "dataset.json": b'{"labels": null}'})
    dataset = ImageFolderDataset(path)
    assert dataset.num_channels == 1
    with pytest.raises(DatasetError, match=r"has shape 3x8x8 but the first image has 1x8x8; mixed channel counts"):
        dataset[1]


def test_any_format_reads_what_pil_reads_and_only_then(tmp_path):
    jpeg = io.BytesIO()
    PIL.Image.fromarray(np.full((8, 8), 90, np.uint8)).save(jpeg, format="jpeg")
    path = write_members(tmp_path / "d", {"a.jpg": jpeg.getvalue(), "b.png": png_file(np.zeros((8, 8, 3), np.uint8))})
    with pytest.raises(DatasetError, match=r"holds \.jpg images beside the \.png/\.npy ones"):
        ImageFolderDataset(path)
    dataset = ImageFolderDataset(path, any_format=True)
    assert dataset.fnames == ["a.jpg", "b.png"] and dataset.image_shape == [3, 8, 8]
    assert (dataset[0][0] == 90).all()  # a flat gray JPEG decodes exactly, repeated to RGB


# ---------------------------------------------------------------------------------------------------
# Hostile files: sizes declared in headers, bombs, duplicates, non-finite latents.

def npy_with_header(shape, values: bytes = b"\0" * 16) -> bytes:
    """A float32 .npy file whose header declares `shape`, followed by the raw `values` whatever their size."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buffer.getvalue() + values


def npy_file(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def latents_zip(tmp_path, arrays, name="latents.zip"):
    """A latent dataset (no labels) whose image i holds arrays[i] (arrays or raw .npy bytes)."""
    members = {latent_fname(i): a if isinstance(a, bytes) else npy_file(a) for i, a in enumerate(arrays)}
    return write_members(tmp_path, members, name)


GOOD_LATENT = np.zeros((8, 4, 4), np.float32)


@pytest.mark.bad_input
@pytest.mark.parametrize("header, words", [
    ((8, 10**6, 10**6), ["declares shape 8x1000000x1000000 of float32 (32000000000000 bytes) but holds 16 bytes"]),
    ((8, -2, 1), ["declares shape 8x-2x1"]),
    ((2, 2), ["declares shape 2x2 of float32 (16 bytes) but holds 4 bytes"]),
])
def test_a_latent_header_must_agree_with_the_files_size(tmp_path, header, words):
    path = latents_zip(tmp_path, [npy_with_header(header, b"\0" * (4 if header == (2, 2) else 16))])
    with pytest.raises(DatasetError) as info:
        ImageFolderDataset(path)
    assert all(word in str(info.value) for word in [str(path), latent_fname(0), *words]), info.value


@pytest.mark.bad_input
def test_a_later_latent_of_another_shape_is_refused_by_its_header(tmp_path):
    # Its values (16 bytes) fit its header, but the header disagrees with the first image: refused before loading.
    path = latents_zip(tmp_path, [GOOD_LATENT, npy_with_header((1, 2, 2)), npy_with_header((8, 10**6, 10**6))])
    dataset = ImageFolderDataset(path)
    with pytest.raises(DatasetError, match=f"{latent_fname(1)} has shape 1x2x2 but the first image has 8x4x4"):
        dataset[1]
    with pytest.raises(DatasetError, match=f"{latent_fname(2)} declares shape 8x1000000x1000000"):
        dataset[2]


@pytest.mark.bad_input
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_latents_are_refused_when_read_naming_the_file(tmp_path, value):
    bad = GOOD_LATENT.copy()
    bad[3, 2, 1] = value
    path = latents_zip(tmp_path, [GOOD_LATENT, bad])
    dataset = ImageFolderDataset(path)
    assert np.array_equal(dataset[0][0], GOOD_LATENT)
    with pytest.raises(DatasetError) as info:
        dataset[1]
    assert f"{path}: {latent_fname(1)} holds non-finite values" in str(info.value)
    with pytest.raises(DatasetError, match="non-finite"):  # all NaN, as the first image: refused when opened
        ImageFolderDataset(latents_zip(tmp_path, [np.full((8, 4, 4), np.nan, np.float32)], "nan.zip"))


@pytest.mark.bad_input
def test_a_non_finite_latent_met_by_a_data_loader_worker_ends_training_in_one_line(tmp_path):
    # The first batch (32 of 16 images) holds image 9; the worker's error reaches the user as one line naming the
    # file, and the process ends (workers ignore SIGTERM, which once left it waiting for them forever).
    arrays = [np.random.default_rng(i).standard_normal((8, 8, 8)).astype(np.float32) for i in range(16)]
    arrays[9][0, 0, 0] = np.nan
    data = latents_zip(tmp_path, arrays)
    assert_refused(tmp_path, lambda: run_training_process(data, tmp_path / "run", "--cond=False", "--workers=1"),
                   "--data", f"{data}: {latent_fname(9)} holds non-finite values")


def test_latents_of_other_dtypes_and_fortran_order_read_as_float32(tmp_path):
    rng = np.random.default_rng(2)
    values = rng.standard_normal((8, 4, 4))
    path = latents_zip(tmp_path, [values.astype(">f8"), np.asfortranarray(values.astype(np.float16))])
    dataset = ImageFolderDataset(path)
    assert np.array_equal(dataset[0][0], values.astype(np.float32))
    assert np.array_equal(dataset[1][0], values.astype(np.float16).astype(np.float32))
    assert all(dataset[i][0].dtype == np.float32 and dataset[i][0].flags.c_contiguous for i in range(2))


@pytest.mark.bad_input
def test_a_zip_naming_a_member_twice_is_refused(tmp_path):
    path = tmp_path / "twice.zip"
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(path, "w") as archive:
        archive.writestr(image_fname(0), png_file(np.zeros((8, 8, 3), np.uint8)))
        archive.writestr(image_fname(1), png_file(np.zeros((8, 8, 3), np.uint8)))
        archive.writestr(image_fname(0), png_file(np.full((8, 8, 3), 255, np.uint8)))
    with pytest.raises(DatasetError, match=f"{path}: holds the member {image_fname(0)} twice"):
        ImageFolderDataset(path)
    args = ["--preset", "toy-tiny", "--data", str(path), "--outdir", str(tmp_path / "run"), "--dry-run"]
    assert_refused(tmp_path, lambda: CliRunner().invoke(train_edm2.main, args), "--data", "twice")


@pytest.mark.bad_input
def test_a_zip_member_inflating_beyond_deflate_is_a_bomb(tmp_path):
    # bzip2 packs 4 MiB of zeros into under a hundred bytes; deflate cannot exceed 1032:1.
    path = tmp_path / "bomb.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_BZIP2) as archive:
        archive.writestr(image_fname(0), bytes(4 << 20))
    with pytest.raises(DatasetError, match=f"{image_fname(0)} declares 4194304 bytes from .* a decompression bomb"):
        ImageFolderDataset(path)


@pytest.mark.parametrize("as_zip", [False, True])
def test_no_file_is_read_beyond_the_limit(tmp_path, as_zip):
    files = FileTree(write_members(tmp_path, {"a.bin": bytes(101)}, "d.zip" if as_zip else None))
    assert files.read("a.bin", limit=101) == bytes(101)
    with pytest.raises(DatasetError, match="a.bin .*more than the 100"):
        files.read("a.bin", limit=100)


@pytest.mark.bad_input
def test_an_image_declaring_more_pixels_than_the_bound_is_refused_from_its_header(tmp_path):
    side = math.isqrt(MAX_IMAGE_PIXELS) + 1
    path = write_members(tmp_path, {image_fname(0): black_png(side, side, 1)}, "big.zip")
    with pytest.raises(DatasetError, match=f"cannot read {image_fname(0)} .*declares {side}x{side} pixels"):
        ImageFolderDataset(path)


def test_palette_pngs_are_read_as_the_rgb_they_show_by_training_and_metrics(tmp_path):
    # Palette indices are no gray levels: both readers decode the colours, as PIL's conversion gives them.
    rng = np.random.default_rng(3)
    palette = rng.integers(0, 256, 256 * 3, dtype=np.uint8)
    members, expected = {}, []
    for i in range(2):
        image = PIL.Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), "P")
        image.putpalette(palette.tolist())
        buffer = io.BytesIO()
        image.save(buffer, format="png")
        assert PIL.Image.open(io.BytesIO(buffer.getvalue())).mode == "P"
        members[image_fname(i)] = buffer.getvalue()
        expected.append(np.asarray(image.convert("RGB")).transpose(2, 0, 1))
    path = write_members(tmp_path, members, "palette.zip")
    for dataset in (ImageFolderDataset(path), ImageFolderDataset(path, any_format=True)):
        assert dataset.num_channels == 3 and all(np.array_equal(dataset[i][0], expected[i]) for i in range(2))
    args = ["--preset", "toy-tiny", "--data", str(path), "--outdir", str(tmp_path / "run"), "--dry-run",
            "--cond=False"]
    result = CliRunner().invoke(train_edm2.main, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[: result.output.rindex("}") + 1])["dataset"]["num_channels"] == 3


def test_bilevel_pngs_are_read_as_gray(tmp_path):
    pixels = np.random.default_rng(4).integers(0, 2, (8, 8)).astype(bool)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buffer, format="png")
    dataset = ImageFolderDataset(write_members(tmp_path, {image_fname(0): buffer.getvalue()}, "bits.zip"))
    assert np.array_equal(dataset[0][0], pixels[None].astype(np.uint8) * 255)


def test_symlinked_folders_are_followed_and_loops_are_not(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    write_members(root, {"a/x.png": b"x"})
    write_members(outside, {"y.png": b"y", "deep/z.png": b"z"})
    (root / "b").symlink_to(outside, target_is_directory=True)
    (root / "a" / "loop").symlink_to(root, target_is_directory=True)  # back to an ancestor
    (outside / "deep" / "up").symlink_to(outside, target_is_directory=True)
    assert FileTree(root).names == ["a/x.png", "b/deep/z.png", "b/y.png"]


# ---------------------------------------------------------------------------------------------------
# Each hostile size is refused in one line by the command that reads it, within a memory bound: its address
# space capped at what it needs for a good dataset of the same kind plus 1 GiB.

GIB = 1 << 30


@pytest.fixture(scope="module")
def dry_run_peak(tmp_path_factory):
    """The peak address space of train_edm2.py --dry-run on a good 8x8 dataset."""
    root = tmp_path_factory.mktemp("baseline")
    data = write_image_dataset(root / "data", num=4)
    result, peak = run_python_script(["train_edm2.py", "--preset=toy-tiny", f"--data={data}",
                                      f"--outdir={root / 'run'}", "--dry-run"])
    assert result.returncode == 0 and peak > 0, result.stdout + result.stderr
    return peak


def labeled_zip(tmp_path, dataset_json: bytes):
    """Two 8x8 images with the given dataset.json."""
    image = png_file(np.zeros((8, 8, 3), np.uint8))
    return write_members(tmp_path, {image_fname(0): image, image_fname(1): image, "dataset.json": dataset_json},
                         "data.zip")


HOSTILE_DATASETS = {
    "latent declaring (8, 1e6, 1e6)": (lambda t: latents_zip(t, [npy_with_header((8, 10**6, 10**6))]),
                                       ["declares shape 8x1000000x1000000"]),
    "PNG inflating to 3 GiB": (lambda t: png_bomb_zip(t, 32768), [image_fname(0), "decompression bomb"]),
    "PNG inflating to 256 MiB, beyond the pixel bound": (lambda t: png_bomb_zip(t, 8200, 4),
                                                         [image_fname(0), "declares 8200x8200 pixels"]),
    "dataset.json nested 100,000 lists deep": (lambda t: labeled_zip(t, b"[" * 100_000 + b"]" * 100_000),
                                               ["dataset.json", "nested 100000 levels"]),
    "label 10**30": (lambda t: labeled_zip(t, labels_file(b"1" + b"0" * 30)), ["dataset.json", "20 digits"]),
    "a 2**40-class one-hot": (lambda t: labeled_zip(t, labels_file(str(2**40).encode())),
                              ["dataset.json", "below 1048576", str(2**40)]),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("case", HOSTILE_DATASETS)
def test_hostile_sizes_are_refused_within_a_memory_bound(tmp_path, case, dry_run_peak):
    build, words = HOSTILE_DATASETS[case]
    data = build(tmp_path)
    args = ["train_edm2.py", "--preset=toy-tiny", f"--data={data}", f"--outdir={tmp_path / 'run'}", "--dry-run"]
    assert_refused(tmp_path, lambda: run_python_script(args, dry_run_peak + GIB)[0], "--data", *words)


def zip_with_odd_member(path, odd: str, how: str):
    """A ZIP of four 8x8 PNGs and dataset.json; member `odd` marked encrypted, or compressed by method 93 (Zstandard,
    which zipfile lacks), in both its local header and the central directory."""
    pixels = np.zeros((8, 8, 3), np.uint8)
    names = [image_fname(i) for i in range(4)]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name in names:
            archive.writestr(name, png_file(pixels))
        archive.writestr("dataset.json", json.dumps({"labels": [[name, 0] for name in names]}))
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(odd)
    data = bytearray(path.read_bytes())
    central = data.rindex(odd.encode()) - 46  # the central directory comes last; 46 fixed bytes precede a name
    assert data[central:central + 4] == b"PK\x01\x02"
    if how == "encrypted":
        data[info.header_offset + 6] |= 1
        data[central + 8] |= 1
    else:
        data[info.header_offset + 8:info.header_offset + 10] = (93).to_bytes(2, "little")
        data[central + 10:central + 12] = (93).to_bytes(2, "little")
    path.write_bytes(bytes(data))
    return path


@pytest.mark.bad_input
@pytest.mark.parametrize("how, message", [("encrypted", "is encrypted"),
                                          ("zstd", "is compressed with method 93, which this Python cannot read")])
def test_an_encrypted_or_unreadably_compressed_zip_member_is_one_line_naming_it(how, message, tmp_path):
    odd = image_fname(2)
    path = zip_with_odd_member(tmp_path / "data.zip", odd, how)
    with pytest.raises(DatasetError, match=f"data.zip: {odd} {message}"):
        dataset = ImageFolderDataset(path)
        [dataset[i] for i in range(len(dataset))]
    result = CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, f"--data={path}", f"--outdir={tmp_path / 'run'}",
                                                  "--workers=0"])
    assert_one_error_line(result, odd, message)
    dest = tmp_path / "converted.zip"
    result = CliRunner().invoke(dataset_tool.main, ["convert", "--source", str(path), "--dest", str(dest)])
    assert_one_error_line(result, odd, message)
    assert not dest.exists()
