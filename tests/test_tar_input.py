"""Webdataset tar input: every malformed archive, non-regular file or member is one line naming the archive, the
member and what is wrong, before anything is written; and each tar is read once in order, however small the shards
or batches."""

import gzip
import io
import os
import tarfile

import numpy as np
import PIL.Image
import pytest
import torch

from edm2.data.shards import ShardDataset
from edm2.data.shard_convert import convert_to_shards, encode_to_shards, source_index
from edm2.data.tar_source import MAX_MEMBER_BYTES, TarSource
from edm2.data.transforms import make_transform
from edm2.encoders import RELEASE_ENCODINGS, PIXELS
from tests.helpers import assert_refused, run_dataset_tool as run



def png(seed: int, size: int = 8) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
        buffer, format="png")
    return buffer.getvalue()


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    member = tarfile.TarInfo(name)
    member.size = len(data)
    tar.addfile(member, io.BytesIO(data))


def write_tar(path, count: int = 3, first: int = 0, extra=(), mode: str = "w"):
    """A tar of `count` samples (KEY.png, KEY.cls) and then the (name, data) members of extra."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, mode) as tar:
        for i in range(first, first + count):
            add(tar, f"{i:04d}.png", png(i))
            add(tar, f"{i:04d}.cls", str(i % 2).encode())
        for name, data in extra:
            add(tar, name, data)
    return path


def convert(source, dest):
    return run("convert", "--source", source, "--dest", dest)


def refused(tmp_path, source, *words):
    """convert into shards is one line holding every word, and leaves tmp_path as it was."""
    return assert_refused(tmp_path, lambda: convert(source, tmp_path / "t.shards"), *words)


# ----------------------------------------------------------------------------------------------
# The malformed archives.

def test_a_key_given_twice_in_a_row_names_the_archive_and_member(tmp_path):
    tar = write_tar(tmp_path / "a.tar", extra=[("0002.png", png(9))])
    refused(tmp_path, tar, "a.tar", "member 0002.png", "sample 0002 has its .png twice")


def test_a_key_given_again_after_other_samples_is_refused(tmp_path):
    tar = write_tar(tmp_path / "a.tar", extra=[("0000.png", png(9)), ("0000.cls", b"1")])
    refused(tmp_path, tar, "a.tar", "member 0000.png", "appears a second time")


def test_a_json_sidecar_nested_200000_levels_is_one_line(tmp_path):
    tar = write_tar(tmp_path / "a.tar", count=0, extra=[("0000.png", png(0)),
                                                        ("0000.json", b"[" * 200_000 + b"]" * 200_000)])
    refused(tmp_path, tar, "a.tar", "member 0000.json", "nested 200000 levels")


def test_a_json_sidecar_with_a_key_twice_is_one_line(tmp_path):
    tar = write_tar(tmp_path / "a.tar", count=0,
                    extra=[("0000.png", png(0)), ("0000.json", b'{"label": 1, "label": 2}')])
    refused(tmp_path, tar, "member 0000.json", "the key label appears twice")


def test_a_class_of_5000_digits_is_one_line(tmp_path):
    tar = write_tar(tmp_path / "a.tar", count=0, extra=[("0000.png", png(0)), ("0000.cls", b"7" * 5000)])
    refused(tmp_path, tar, "a.tar", "sample 0000 has class 7777", "not a non-negative integer of at most 20 digits")


def test_a_member_declaring_8_gib_in_a_file_that_ends_there(tmp_path):
    tar = write_tar(tmp_path / "a.tar", count=1)
    header = tarfile.TarInfo("0001.png")
    header.size = 8 << 30
    whole = tar.read_bytes()
    end = whole.rstrip(b"\0")
    end += bytes(-len(end) % tarfile.BLOCKSIZE)  # the last member's data padded to its block
    tar.write_bytes(end + header.tobuf())
    refused(tmp_path, tar, "a.tar", "member 0001.png", f"declares {8 << 30} bytes", f"the {MAX_MEMBER_BYTES}")


def test_a_member_cut_within_its_data(tmp_path):
    tar = write_tar(tmp_path / "a.tar", count=1, extra=[("0001.png", png(1, size=64))])
    whole = tar.read_bytes()
    tar.write_bytes(whole[:whole.index(b"0001.png") + tarfile.BLOCKSIZE + 100])
    refused(tmp_path, tar, "a.tar", "in or after member 0001.png", "a damaged or cut tar")


def test_a_tar_cut_between_members_has_no_end_of_archive_block(tmp_path):
    tar = write_tar(tmp_path / "a.tar", count=2)
    whole = tar.read_bytes()
    tar.write_bytes(whole[:whole.index(b"0001.png")])  # ends where the second sample's header would start
    refused(tmp_path, tar, "a.tar", "after member 0000.cls", "without its end-of-archive block")


@pytest.mark.parametrize("kept", [0.5, 0.9, 0.99])
def test_a_gzip_tar_cut_mid_stream(tmp_path, kept):
    tar = write_tar(tmp_path / "a.tar", count=4, mode="w:gz")
    whole = tar.read_bytes()
    assert gzip.decompress(whole)  # a whole gzip tar, before the cut
    tar.write_bytes(whole[:int(len(whole) * kept)])
    refused(tmp_path, tar, "a.tar", "cannot read the archive", "a damaged or cut tar")


def test_a_whole_gzip_tar_reads_as_the_plain_one(tmp_path):
    plain = TarSource(write_tar(tmp_path / "p.tar"), make_transform(None, None))
    packed = TarSource(write_tar(tmp_path / "z.tar", mode="w:gz"), make_transform(None, None))
    assert np.array_equal(plain.pixels(0, 3), packed.pixels(0, 3))
    assert np.array_equal(plain.labels, packed.labels)


def test_a_garbage_file_named_tar_in_a_folder_of_tars(tmp_path):
    write_tar(tmp_path / "tars" / "00000.tar")
    (tmp_path / "tars" / "00001.tar").write_bytes(os.urandom(3000))
    refused(tmp_path, tmp_path / "tars", "00001.tar", "cannot read the archive at its first member")


# ----------------------------------------------------------------------------------------------
# Non-regular files and members.

def test_a_fifo_named_tar_among_the_sources_is_refused_without_waiting(tmp_path):
    write_tar(tmp_path / "tars" / "00000.tar")
    os.mkfifo(tmp_path / "tars" / "00001.tar")
    refused(tmp_path, tmp_path / "tars", "00001.tar", "a FIFO, not a regular file")


def test_a_folder_named_tar_among_the_sources_is_refused(tmp_path):
    write_tar(tmp_path / "tars" / "00000.tar")
    (tmp_path / "tars" / "00001.tar").mkdir()
    refused(tmp_path, tmp_path / "tars", "00001.tar", "not a regular file")


@pytest.mark.parametrize("kind, words", [(tarfile.SYMTYPE, "a symbolic link"), (tarfile.LNKTYPE, "a hard link"),
                                         (tarfile.FIFOTYPE, "a FIFO"), (tarfile.CHRTYPE, "a character device")])
def test_a_member_that_is_no_regular_file_is_refused(tmp_path, kind, words):
    tar = write_tar(tmp_path / "a.tar", count=1)
    with tarfile.open(tar, "a") as archive:
        member = tarfile.TarInfo("0001.png")
        member.type, member.linkname = kind, "0000.png"
        archive.addfile(member)
    refused(tmp_path, tar, "a.tar", "member 0001.png", words, "not a regular file")


def test_folder_members_are_passed_over(tmp_path):
    tar = write_tar(tmp_path / "a.tar", count=1)
    with tarfile.open(tar, "a") as archive:
        folder = tarfile.TarInfo("more")
        folder.type = tarfile.DIRTYPE
        archive.addfile(folder)
        add(archive, "more/0001.png", png(1))
        add(archive, "more/0001.cls", b"1")
    source = TarSource(tar, make_transform(None, None))
    assert len(source) == 2 and source.labels.tolist() == [0, 1]


# ----------------------------------------------------------------------------------------------
# Read once, in order.

@pytest.fixture
def counted_opens(monkeypatch):
    """The tars opened for reading (tarfile.open calls) since the fixture was made."""
    opened = []
    real = tarfile.open

    def counting(*args, **kwargs):
        if kwargs.get("mode", args[1] if len(args) > 1 else "r").startswith("r"):
            opened.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(tarfile, "open", counting)
    return opened


def tar_folder(tmp_path, counts=(5, 4)):
    first = 0
    for t, count in enumerate(counts):
        write_tar(tmp_path / "tars" / f"{t:05d}.tar", count=count, first=first)
        first += count
    return tmp_path / "tars"


def test_one_sample_shards_read_each_tar_once_after_listing_it(tmp_path, counted_opens):
    folder = tar_folder(tmp_path)
    result = run("convert", "--source", folder, "--dest", tmp_path / "t.shards", "--shard-size", 1)
    assert result.exit_code == 0, result.output
    assert len(counted_opens) == 2 * 2  # each of the two tars: once listed and checked, once read


def test_encode_in_batches_of_one_reads_each_tar_once_after_listing_it(tmp_path, counted_opens):
    source = TarSource(tar_folder(tmp_path), make_transform(None, None))
    encoder = ScaledPixels()
    index = source_index(source, encoder.dataset_record(), source.image_shape, {"source": "tars"}, shard_size=3)
    encode_to_shards(source, tmp_path / "t.shards", index, encoder, batch=1, report=lambda line: None)
    assert len(counted_opens) == 2 * 2
    shards = ShardDataset(tmp_path / "t.shards")
    expected = source.pixels(0, 9).astype(np.float32) / 255
    assert np.array_equal(np.stack([shards[i][0] for i in range(9)]), expected)


class ScaledPixels:
    """A stand-in for a VAE that stores float32 samples: pixels / 255, one batch at a time."""

    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """The batch as float32 in [0, 1]."""
        return pixels.to(torch.float32) / 255

    def dataset_record(self) -> dict:
        """The record of a float32 (latent) encoding."""
        return {"encoding": "stability-vae"}


def test_samples_read_in_any_order_are_the_samples_read_in_order(tmp_path):
    source = TarSource(tar_folder(tmp_path), make_transform(None, None))
    in_order = source.pixels(0, 9)
    for first, n in [(7, 2), (0, 1), (4, 3), (4, 1), (2, 7), (8, 1), (3, 2)]:
        assert np.array_equal(source.pixels(first, n), in_order[first:first + n])


def test_converted_one_sample_shards_hold_the_tar_samples_in_order(tmp_path):
    source = TarSource(tar_folder(tmp_path), make_transform(None, None))
    expected = np.stack([np.asarray(PIL.Image.open(io.BytesIO(png(i)))).transpose(2, 0, 1) for i in range(9)])
    index = source_index(source, RELEASE_ENCODINGS[PIXELS]().dataset_record(), source.image_shape, {}, shard_size=1)
    convert_to_shards(source, tmp_path / "t.shards", index, report=lambda line: None)
    shards = ShardDataset(tmp_path / "t.shards")
    assert np.array_equal(np.stack([shards[i][0] for i in range(9)]), expected)
    assert [int(shards.raw_labels[i]) for i in range(9)] == [i % 2 for i in range(9)]


# ----------------------------------------------------------------------------------------------
# encode reads tars as convert does.

def test_encode_refuses_a_malformed_tar_in_one_line_before_loading_the_vae(tmp_path):
    tar = write_tar(tmp_path / "a.tar", extra=[("0002.png", png(9))])
    missing = tmp_path / "no-vae"  # never loaded: the source is checked first
    assert_refused(tmp_path, lambda: run("encode", "--source", tar, "--dest", tmp_path / "t.shards",
                                         "--vae", missing), "a.tar", "member 0002.png", "has its .png twice")
