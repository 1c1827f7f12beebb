"""Captions in the data: read from metadata.jsonl, NAME.txt and webdataset txt/json; stored in dataset.json and in
shard captions files and read back unchanged through every conversion; the captioned toy, its hold-out and the
pixel measurement of colour and side; and every bad input refused in one line."""

import io
import json
import tarfile
import zipfile

import numpy as np
import pytest

from edm2.data import shard_writer
from edm2.data.captions import MAX_CAPTION_BYTES, CaptionError
from edm2.data.dataset import DatasetError, ImageFolderDataset
from edm2.data.dataset_writer import labels_json
from edm2.data.shards import ShardDataset, captions_name, shard_name
from edm2.data.sources import open_data
from edm2.data.toy_shapes import (COLOURS, SHAPES, TOY_BACKGROUND, ToyParams, caption_of, captioned_params,
                                  colour_name, draw_toy, measure_adherence, side_of, toy_image)
from tests.helpers import assert_ok, assert_refused, png_file, run_dataset_tool as run, write_members

# Captions that a careless reader would damage: non-ASCII, quotes, a JSON-looking text, an empty one.
CAPTIONS = ["a cat on a mat", "café ☕ «quoted» \"text\"", '{"text": 1}', "", "zwei Hunde\tim Schnee"]


def images(count: int, size: int = 8, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [png_file(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def captions_of(dataset) -> list[str]:
    return [dataset.get_caption(i) for i in range(len(dataset))]


def metadata_line(name: str, text: object) -> str:
    return json.dumps({"file_name": name, "text": text})


def metadata_folder(root, captions=CAPTIONS, zip_name=None):
    """Images in two class folders, captioned by a top-level metadata.jsonl (the Hugging Face convention)."""
    names = [f"{'ab'[i // 3]}/img{i}.png" for i in range(len(captions))]  # sorted: image i has caption i
    members = dict(zip(names, images(len(names))))
    members["metadata.jsonl"] = "\n".join(metadata_line(n, t) for n, t in zip(names, captions)).encode()
    return write_members(root, members, zip_name), names


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    member = tarfile.TarInfo(name)
    member.size = len(data)
    tar.addfile(member, io.BytesIO(data))


def write_tar(path, samples: list[dict]) -> None:
    """A webdataset tar: sample i as KEY.png plus its {extension: bytes} members."""
    with tarfile.open(path, "w") as tar:
        for i, (sample, png) in enumerate(zip(samples, images(len(samples)))):
            add_member(tar, f"s{i:04d}.png", png)
            for ext, data in sample.items():
                add_member(tar, f"s{i:04d}.{ext}", data)


def test_metadata_jsonl_captions_travel_with_labels_through_zip_folder_and_shards(tmp_path):
    source, _ = metadata_folder(tmp_path / "src")
    for dest, extra in (("d.zip", []), ("d", []), ("d.shards", ["--shard-size", 2])):
        result = run("convert", "--source", source, "--dest", tmp_path / dest, *extra)
        assert_ok(result)
        assert f"{len(CAPTIONS)} " in result.output and "with their captions to" in result.output, dest
    for dest in ("d.zip", "d", "d.shards"):
        dataset = open_data(tmp_path / dest)
        assert dataset.has_captions and captions_of(dataset) == CAPTIONS, dest
        assert dataset.has_labels and list(dataset.raw_labels) == [i // 3 for i in range(len(CAPTIONS))], dest
    stored = json.loads(zipfile.ZipFile(tmp_path / "d.zip").read("dataset.json"))
    assert [name for name, _ in stored["captions"]] == [f"00000/img{i:08d}.png" for i in range(len(CAPTIONS))]
    index = json.loads((tmp_path / "d.shards" / "index.json").read_text())
    assert index["captions"] is True
    assert json.loads((tmp_path / "d.shards" / captions_name(1)).read_text()) == CAPTIONS[2:4]


def test_metadata_jsonl_in_a_sub_folder_names_files_relative_to_it(tmp_path):
    members = dict(zip(["x/a.png", "x/b.png"], images(2)))
    members["x/metadata.jsonl"] = (metadata_line("a.png", "first") + "\n\n" + metadata_line("b.png", "second")).encode()
    write_members(tmp_path / "src", members)
    assert_ok(run("convert", "--source", tmp_path / "src", "--dest", tmp_path / "d.zip"))
    assert captions_of(ImageFolderDataset(tmp_path / "d.zip")) == ["first", "second"]


def test_text_files_beside_images_give_captions_and_resizing_leaves_them(tmp_path):
    members = dict(zip([f"p{i}.png" for i in range(3)], images(3, size=12)))
    texts = ["  a red kite\n", "ein Bär\r\n", ""]
    members.update({f"p{i}.txt": text.encode() for i, text in enumerate(texts)})
    members["p0.txt"] = b"\xef\xbb\xbf" + members["p0.txt"]  # a byte-order mark, as some editors write
    write_members(tmp_path, members, zip_name="src.zip")
    assert_ok(run("convert", "--source", tmp_path / "src.zip", "--dest", tmp_path / "d.zip",
                  "--resolution", 8, "--transform", "center-crop"))
    dataset = ImageFolderDataset(tmp_path / "d.zip")
    assert dataset.resolution == 8 and captions_of(dataset) == [t.strip() for t in texts]
    assert not dataset.has_labels  # captions, no labels


def test_copying_a_dataset_keeps_its_captions(tmp_path):
    source, _ = metadata_folder(tmp_path / "src")
    assert_ok(run("convert", "--source", source, "--dest", tmp_path / "a.zip"))
    assert_ok(run("convert", "--source", tmp_path / "a.zip", "--dest", tmp_path / "b.zip"))  # ours to ours
    assert_ok(run("convert", "--source", tmp_path / "b.zip", "--dest", tmp_path / "b.shards"))  # to shards
    assert_ok(run("convert", "--source", tmp_path / "b.shards", "--dest", tmp_path / "c.shards", "--shard-size", 3))
    for dest in ("b.zip", "b.shards", "c.shards"):
        dataset = open_data(tmp_path / dest)
        assert captions_of(dataset) == CAPTIONS, dest
    first, copy = ImageFolderDataset(tmp_path / "a.zip"), ShardDataset(tmp_path / "c.shards")
    assert all(np.array_equal(first[i][0], copy[i][0]) for i in range(len(first)))


def test_webdataset_captions_from_txt_then_json_text_then_json_caption(tmp_path):
    samples = [{"txt": "from txt".encode(), "json": b'{"caption": "ignored", "label": 1}'},  # img2dataset's layout
               {"json": b'{"text": "from text", "caption": "ignored", "label": 2}'},
               {"json": b'{"caption": "from caption", "label": 3}'}]
    write_tar(tmp_path / "data.tar", samples)
    assert_ok(run("convert", "--source", tmp_path / "data.tar", "--dest", tmp_path / "d.zip"))
    assert_ok(run("convert", "--source", tmp_path / "data.tar", "--dest", tmp_path / "d.shards"))
    for dest in ("d.zip", "d.shards"):
        dataset = open_data(tmp_path / dest)
        assert captions_of(dataset) == ["from txt", "from text", "from caption"], dest
        assert list(dataset.raw_labels) == [1, 2, 3], dest


def test_a_dataset_without_captions_has_none_and_says_so(tmp_path):
    write_members(tmp_path / "src", dict(zip(["a.png", "b.png"], images(2))))
    result = run("convert", "--source", tmp_path / "src", "--dest", tmp_path / "d.zip")
    assert_ok(result)
    assert "captions" not in result.output
    assert_ok(run("convert", "--source", tmp_path / "d.zip", "--dest", tmp_path / "d.shards"))
    for dest in ("d.zip", "d.shards"):
        dataset = open_data(tmp_path / dest)
        assert not dataset.has_captions
        with pytest.raises(CaptionError, match="has no captions"):
            dataset.get_caption(0)
    assert "captions" not in json.loads(zipfile.ZipFile(tmp_path / "d.zip").read("dataset.json"))
    assert "captions" not in json.loads((tmp_path / "d.shards" / "index.json").read_text())


def test_the_writer_refuses_captions_for_some_images_only():
    with pytest.raises(CaptionError, match="b.png has no caption"):
        labels_json({"a.png": None, "b.png": None}, captions={"a.png": "x", "b.png": None})


@pytest.mark.parametrize("members, fragments", [
    ({"a.png": 0, "a.txt": b"caf\xe9"}, ["a.txt", "not UTF-8"]),
    ({"a.png": 0, "metadata.jsonl": metadata_line("a.png", 7).encode()}, ["line 1", "JSON int, not text"]),
    ({"a.png": 0, "metadata.jsonl": b"\n\n"}, ["metadata.jsonl is empty"]),
    ({"a.png": 0, "metadata.jsonl": metadata_line("gone.png", "x").encode()}, ["gone.png", "no image"]),
    ({"a.png": 0, "metadata.jsonl": metadata_line("a.png", "x").encode(), "a.txt": b"y"},
     ["a.png has a caption in metadata.jsonl and in a.txt"]),
    ({"a.png": 0, "b.png": 1, "a.txt": b"y"}, ["b.png has no caption", "1 of 2"]),
    ({"a.png": 0, "metadata.jsonl": (metadata_line("a.png", "x") + "\n" + metadata_line("a.png", "y")).encode()},
     ["line 2", "second caption"]),
    ({"a.png": 0, "metadata.jsonl": b'{"file_name": "a.png"}'}, ["line 1", "not an object"]),
    ({"a.png": 0, "metadata.jsonl": b"{not json"}, ["line 1", "not valid JSON"]),
    ({"x/a.png": 0, "metadata.jsonl": metadata_line("x/a.png", "x").encode(),
      "x/metadata.jsonl": metadata_line("a.png", "y").encode()}, ["x/a.png has a caption in two metadata.jsonl"]),
    ({"a.png": 0, "a.txt": b"x" * (MAX_CAPTION_BYTES + 1)}, ["a.txt", "more than"]),
])
def test_bad_captions_in_an_image_folder_are_one_line(tmp_path, members, fragments):
    pictures = images(2)
    write_members(tmp_path / "src", {name: pictures[data] if isinstance(data, int) else data
                                     for name, data in members.items()})
    for dest in ("d.zip", "d.shards"):
        assert_refused(tmp_path, lambda: run("convert", "--source", tmp_path / "src", "--dest", tmp_path / dest),
                       "--source", *fragments)


@pytest.mark.parametrize("samples, fragments", [
    ([{"txt": b"\xff\xfe"}], ["s0000.txt", "not UTF-8"]),
    ([{"json": b'{"text": 3}'}], ["s0000.json", "JSON int, not text"]),
    ([{"json": b'{"caption": ["a"]}'}], ["s0000.json", "JSON list, not text"]),
    ([{"txt": b"a"}, {}], ["s0001", "no caption", "the first sample has"]),
])
def test_bad_captions_in_tar_shards_are_one_line(tmp_path, samples, fragments):
    write_tar(tmp_path / "data.tar", samples)
    assert_refused(tmp_path, lambda: run("convert", "--source", tmp_path / "data.tar", "--dest", tmp_path / "d.zip"),
                   "--source", *fragments)


def test_stored_captions_are_checked_when_read(tmp_path):
    source, _ = metadata_folder(tmp_path / "src")
    assert_ok(run("convert", "--source", source, "--dest", tmp_path / "d"))
    record = tmp_path / "d" / "dataset.json"
    stored = json.loads(record.read_text())
    for broken, fragment in [(stored["captions"][1:], "no caption for 00000/img00000000.png"),
                             ([[n, 5] for n, _ in stored["captions"]], "JSON int, not text"),
                             (stored["captions"] + stored["captions"][:1], "lists an image twice"),
                             ({"a": "b"}, "not a list of [name, caption] pairs")]:
        record.write_text(json.dumps(dict(stored, captions=broken)))
        with pytest.raises(DatasetError, match=fragment.replace("[", r"\[")):
            ImageFolderDataset(tmp_path / "d")
    assert_ok(run("convert", "--source", source, "--dest", tmp_path / "d.shards", "--shard-size", 2))
    part = tmp_path / "d.shards" / captions_name(1)
    part.write_text(json.dumps(CAPTIONS[2:3]))
    dataset = ShardDataset(tmp_path / "d.shards")
    assert dataset.get_caption(0) == CAPTIONS[0]
    with pytest.raises(CaptionError, match="holds 1 entries, not a list of the shard's 2 captions"):
        dataset.get_caption(2)
    part.unlink()
    with pytest.raises(CaptionError, match=f"{captions_name(1)} is missing"):
        ShardDataset(tmp_path / "d.shards")


def test_colour_names_are_the_hue_sextants_centred_on_red():
    edges = {-30: "red", 29.999: "red", 30: "yellow", 89.999: "yellow", 90: "green", 150: "cyan", 210: "blue",
             270: "magenta", 329.999: "magenta", 330: "red", 0: "red", 359.999: "red"}
    for degrees, name in edges.items():
        assert colour_name((degrees % 360) / 360) == name, degrees
    assert side_of(7.99, 16) == "left" and side_of(8.0, 16) == "right"
    params = ToyParams("ring", 16, 5.0, 11.0, 6.0, (2 / 3, 1.0, 1.0))
    assert caption_of(params) == "a blue ring on the right"


@pytest.mark.parametrize("resolution", [16, 32])
def test_adherence_reads_back_every_captioned_toy_image(resolution):
    for i in range(600):
        params = captioned_params(list(SHAPES)[i % len(SHAPES)], resolution, np.random.default_rng([5, i]))
        colour, side = measure_adherence(draw_toy(params))
        assert caption_of(params) == f"a {colour} {params.shape} on the {side}", (i, params)


def test_adherence_measures_what_it_is_shown():
    image = np.full((16, 16, 3), 30, np.uint8)
    assert measure_adherence(image) == (None, None)  # nothing bright: no colour, no side
    image[2:6, 10:15] = (40, 60, 220)  # a blue block, right of the centre
    assert measure_adherence(image) == ("blue", "right")
    image[:, :8] = (230, 220, 30)  # a larger yellow half on the left outweighs it
    assert measure_adherence(image) == ("yellow", "left")


def test_captioned_toy_holds_out_its_combinations_and_keeps_labels(tmp_path):
    assert_ok(run("toy", "--dest", tmp_path / "t.zip", "--resolution", 16, "--num", 240, "--classes", 3,
                  "--captions", "--hold-out", "red:square, blue:circle"))
    dataset = ImageFolderDataset(tmp_path / "t.zip")
    captions = captions_of(dataset)
    assert list(dataset.raw_labels) == [i % 3 for i in range(240)]
    assert not any("red square" in c or "blue circle" in c for c in captions)
    seen = {tuple(c.split()[1:3]) for c in captions}
    assert len(seen) == 3 * len(COLOURS) - 2  # every other combination appears in 240 images
    assert {c.split()[-1] for c in captions} == {"left", "right"}
    for i in range(len(dataset)):
        colour, side = measure_adherence(dataset[i][0].transpose(1, 2, 0))
        assert captions[i] == f"a {colour} {list(SHAPES)[i % 3]} on the {side}"


def test_the_uncaptioned_toy_is_the_toy_it_was(tmp_path):
    assert_ok(run("toy", "--dest", tmp_path / "t.zip", "--resolution", 16, "--num", 10, "--classes", 4))
    dataset = ImageFolderDataset(tmp_path / "t.zip")
    assert not dataset.has_captions
    for i in range(10):
        assert np.array_equal(dataset[i][0].transpose(1, 2, 0),
                              toy_image(list(SHAPES)[i % 4], 16, np.random.default_rng([0, i])))


@pytest.mark.parametrize("args, fragments", [
    (["--hold-out", "red:square"], ["--hold-out", "give --captions too"]),
    (["--captions", "--hold-out", "pink:square"], ["--hold-out", "pink:square", "no COLOUR:SHAPE pair"]),
    (["--captions", "--hold-out", "red:bars"], ["--hold-out", "red:bars"]),  # not among the 2 classes' shapes
    (["--captions", "--hold-out", "red-square"], ["--hold-out", "red-square"]),
    (["--captions", "--hold-out", "red:circle,red:circle"], ["--hold-out", "given twice"]),
    (["--captions", "--hold-out", ",".join(f"{c}:circle" for c in COLOURS)], ["--hold-out", "every colour of circle"]),
])
def test_bad_hold_out_is_one_line(tmp_path, args, fragments):
    assert_refused(tmp_path, lambda: run("toy", "--dest", tmp_path / "t.zip", "--num", 4, "--classes", 2, *args),
                   *fragments)


def test_encode_and_decode_keep_captions(tmp_path, tiny_vae_dir):
    assert_ok(run("toy", "--dest", tmp_path / "toy.zip", "--resolution", 16, "--num", 5, "--classes", 2,
                  "--captions"))
    vae = tiny_vae_dir
    expected = captions_of(ImageFolderDataset(tmp_path / "toy.zip"))
    for dest in ("latents.zip", "latents", "latents.shards"):
        assert_ok(run("encode", "--source", tmp_path / "toy.zip", "--dest", tmp_path / dest, "--vae", vae,
                      "--batch", 5, "--workers", 0))
        assert captions_of(open_data(tmp_path / dest)) == expected, dest
    assert_ok(run("decode", "--source", tmp_path / "latents.zip", "--dest", tmp_path / "decoded.zip", "--vae", vae))
    assert captions_of(ImageFolderDataset(tmp_path / "decoded.zip")) == expected


def test_an_interrupted_captioned_shard_write_resumes_to_the_same_files(tmp_path):
    index = shard_writer.new_index("pixels", [3, 8, 8], 0, 5, {"source": "test"}, shard_size=2, captions=True)
    pixels = np.random.default_rng(0).integers(0, 256, (5, 3, 8, 8), dtype=np.uint8)

    def fill(k, first, n):
        if interrupt and k == 1:
            raise KeyboardInterrupt
        return pixels[first:first + n], None, CAPTIONS[first:first + n]

    interrupt = True
    with pytest.raises(KeyboardInterrupt):
        shard_writer.write_shards(tmp_path / "r.shards", index, fill)
    assert sorted(p.name for p in shard_writer.work_folder(tmp_path / "r.shards").iterdir()) == [
        captions_name(0), "progress.json", "shard-000000.bin"]
    interrupt = False
    assert shard_writer.write_shards(tmp_path / "r.shards", index, fill) == 1
    shard_writer.write_shards(tmp_path / "u.shards", index, fill)
    for name in ["index.json"] + [f(k) for k in range(3) for f in (captions_name, shard_name)]:
        assert (tmp_path / "r.shards" / name).read_bytes() == (tmp_path / "u.shards" / name).read_bytes(), name
    assert captions_of(ShardDataset(tmp_path / "r.shards")) == CAPTIONS
    with pytest.raises(DatasetError, match="captioned dataset, but 0 captions for 2 samples"):
        shard_writer.write_shards(tmp_path / "n.shards", index, lambda k, first, n: (pixels[first:first + n], None))
    stored = json.loads((tmp_path / "u.shards" / "index.json").read_text())
    (tmp_path / "u.shards" / "index.json").write_text(json.dumps(dict(stored, captions=1)))
    with pytest.raises(DatasetError, match="captions is not true or false"):
        ShardDataset(tmp_path / "u.shards")


def test_a_blend_of_captioned_datasets_reads_each_sources_captions(tmp_path):
    assert_ok(run("toy", "--dest", tmp_path / "a.zip", "--resolution", 8, "--num", 3, "--classes", 2, "--captions"))
    assert_ok(run("toy", "--dest", tmp_path / "b.zip", "--resolution", 8, "--num", 2, "--classes", 2, "--captions",
                  "--seed", 1))
    assert_ok(run("toy", "--dest", tmp_path / "c.zip", "--resolution", 8, "--num", 2, "--classes", 2))
    a, b = (ImageFolderDataset(tmp_path / name) for name in ("a.zip", "b.zip"))
    blend = open_data(f"{tmp_path / 'a.zip'}:1,{tmp_path / 'b.zip'}:1")
    assert blend.has_captions and captions_of(blend) == captions_of(a) + captions_of(b)
    mixed = open_data(f"{tmp_path / 'a.zip'}:1,{tmp_path / 'c.zip'}:1")
    assert not mixed.has_captions
    with pytest.raises(CaptionError, match="has no captions"):
        mixed.get_caption(0)


@pytest.mark.parametrize("resolution, radius", [(16, 0.26), (16, 0.36), (32, 0.26)])
def test_the_toy_shapes_differ_in_a_sizeable_part_of_their_pixels(resolution, radius):
    # Same centre, size and colour: whatever tells two shapes apart is their outline alone.
    coverage = {shape: (draw_toy(ToyParams(shape, resolution, radius * resolution, resolution / 2, resolution / 2,
                                           (0.0, 1.0, 1.0)))[..., 0] - TOY_BACKGROUND[0]) / (255 - TOY_BACKGROUND[0])
                for shape in SHAPES}
    for a in SHAPES:
        for b in SHAPES:
            if a < b:
                differ = np.abs(coverage[a] - coverage[b]).sum() / max(coverage[a].sum(), coverage[b].sum())
                assert differ > 0.15, (a, b, differ)  # at least 15% of the larger shape's area differs
