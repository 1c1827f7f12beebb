"""Inputs that are no regular file (a FIFO waits for a writer forever, a device never ends): every reader of a
user's files refuses them in one line naming the file, at once, through files.open_input."""

import contextlib
import errno
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import generate
import train_edm2
from edm2.data import shard_writer
from edm2.data.dataset import ImageFolderDataset, latent_fname
from edm2.data.dataset_files import DatasetError
from edm2.data.dataset_json import LABELS_FILE
from edm2.data.shards import INDEX_FILE, shard_name
from edm2.data.sources import open_data
from edm2.data.vae_datasets import finish_encode
from edm2.errors import EDM2Error, SnapshotError
from edm2.eval import stats_files
from edm2.formats import release_pickle, snapshot
from edm2.procedures.generation import GenerationError, read_generated_labels
from edm2.runtime import bounded_json, files, pinned_files
from training.run import checkpoint, dashboard
from training.run.run_dir import LOCK_FILE
from tests.helpers import TRAIN_ARGS, assert_one_error_line, write_image_dataset


class Waited(BaseException):
    """The deadline expired: no OSError (a reader would report it as a file it cannot read) nor any Exception."""


@contextlib.contextmanager
def deadline(seconds: int = 30):
    """Fail (instead of hanging the suite) if the block waits on a FIFO."""
    def expired(signum, frame):
        raise Waited(f"still waiting after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def test_open_input_refuses_what_is_no_regular_file(tmp_path):
    (tmp_path / "a.json").write_bytes(b"{}")
    with files.open_input(tmp_path / "a.json") as f:
        assert f.read() == b"{}"
    with deadline(), pytest.raises(OSError, match="a FIFO, not a regular file"):
        files.open_input(fifo(tmp_path / "pipe"))
    with pytest.raises(OSError, match="a character device, not a regular file"):
        files.open_input("/dev/zero")
    with pytest.raises(IsADirectoryError):
        files.open_input(tmp_path)


def test_file_kind_says_what_a_path_is(tmp_path):
    (tmp_path / "a.zip").write_bytes(b"")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    kinds = {name: files.file_kind(tmp_path / name) for name in ["a.zip", "link", "missing"]}
    assert kinds == {"a.zip": "a regular file", "link": "a broken link",
                     "missing": f"unreadable ({os.strerror(errno.ENOENT)})"}
    assert (files.file_kind(fifo(tmp_path / "pipe")), files.file_kind("/dev/zero"), files.file_kind(tmp_path)) == (
        "a FIFO", "a character device", "a directory")
    with pytest.raises(DatasetError, match="link: a broken link, not a directory or ZIP file"):
        open_data(tmp_path / "link")


READERS = {  # reader of a user's file, the error it raises, and a fragment of its line
    "json (--config, options, labels)": (bounded_json.read, OSError, "a FIFO"),
    "snapshot (--net, --init, --indir)": (snapshot.read_metadata, SnapshotError, "a FIFO"),
    "statistics (--ref)": (stats_files.load_stats, stats_files.StatsError, "a FIFO"),
    "training state": (checkpoint.load_state, checkpoint.CheckpointError, "a FIFO"),
    "release pickle": (release_pickle.restricted_load, OSError, "a FIFO"),
    "pinned detector weights": (lambda p: pinned_files.read_pinned(p, "0" * 64), OSError, "a FIFO"),
    "generated labels.json": (read_generated_labels, GenerationError, "a FIFO"),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("reader", READERS)
def test_every_reader_refuses_a_fifo_at_once(reader, tmp_path):
    read, error, fragment = READERS[reader]
    path = fifo(tmp_path / "input")
    with deadline(), pytest.raises(error, match=fragment):
        read(path)


@pytest.mark.bad_input
def test_a_fifo_among_dataset_images_or_as_stats_is_one_line(tmp_path):
    data = write_image_dataset(tmp_path / "data", num=4)
    (data / "00000" / "img00000002.png").unlink()
    fifo(data / "00000" / "img00000002.png")
    with deadline(), pytest.raises(DatasetError, match="img00000002.png.*a FIFO"):
        dataset = ImageFolderDataset(data)
        [dataset[i] for i in range(len(dataset))]
    run = tmp_path / "run"
    fifo(run / dashboard.STATS_FILE)
    with deadline(), pytest.raises(dashboard.DashboardError, match="a FIFO"):
        dashboard.stats_rows(run, ["loss"])


@pytest.mark.bad_input
def test_training_on_a_fifo_image_or_config_is_one_line_and_lets_go_of_the_run(tmp_path):
    data = write_image_dataset(tmp_path / "data", num=4)
    (data / "00000" / "img00000001.png").unlink()
    fifo(data / "00000" / "img00000001.png")
    outdir = tmp_path / "run"
    with deadline(60):
        result = CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, "--workers=0", f"--data={data}",
                                                      f"--outdir={outdir}"])
    assert_one_error_line(result, "img00000001.png", "a FIFO")
    assert not (outdir / LOCK_FILE).exists()
    config = fifo(tmp_path / "options.json")
    with deadline():
        result = CliRunner().invoke(train_edm2.main, [f"--config={config}", "--dry-run"])
    assert_one_error_line(result, "--config", "options.json", "a FIFO")
    with deadline():
        result = CliRunner().invoke(generate.main, ["--net", str(fifo(tmp_path / "net.safetensors")),
                                                    "--outdir", str(tmp_path / "out")])
    assert_one_error_line(result, "net.safetensors", "a FIFO")


# Every member of every dataset format: a FIFO where a file of the dataset belongs is refused in one line naming
# the member, at once (check_shard used to open a shard before comparing its size, and waited on a FIFO).

def labeled_shards(path: Path, count: int = 6, shard_size: int = 2) -> Path:
    """A labeled 3x8x8 pixel shard dataset of `count` samples."""
    index = shard_writer.new_index("pixels", [3, 8, 8], 2, count, {}, shard_size)
    shard_writer.write_shards(path, index, lambda k, first, n: (np.full((n, 3, 8, 8), k, np.uint8),
                                                                np.arange(first, first + n) % 2))
    return path


def latent_folder(path: Path) -> Path:
    """A folder of two .npy latents (release names) with dataset.json."""
    for i in range(2):
        (path / latent_fname(i)).parent.mkdir(parents=True, exist_ok=True)
        np.save(path / latent_fname(i), np.zeros((8, 4, 4), np.float32))
    (path / LABELS_FILE).write_text(json.dumps({"labels": None}))
    return path


def read_all(path: Path) -> None:
    """Open the dataset at path (as --data does) and read every sample."""
    dataset = open_data(path)
    [dataset[i] for i in range(len(dataset))]


def shard_replaced_after_opening(tmp_path: Path) -> None:
    dataset = open_data(labeled_shards(tmp_path / "d.shards"))
    replace_by_fifo(tmp_path / "d.shards" / shard_name(1))
    dataset[2]


def resumed_shard_write(tmp_path: Path) -> None:
    index = shard_writer.new_index("pixels", [3, 8, 8], 0, 4, {}, 2)
    shard_writer.prepare(tmp_path / "d.shards", index)
    fifo(shard_writer.work_folder(tmp_path / "d.shards") / shard_name(0))
    shard_writer.write_shards(tmp_path / "d.shards", index, lambda k, first, n: (np.zeros((n, 3, 8, 8), np.uint8),
                                                                                  None))


def finished_encode(tmp_path: Path) -> None:
    data = write_image_dataset(tmp_path / "data", num=2)
    work = tmp_path / "out.zip.partial"
    latent_folder(work)
    replace_by_fifo(work / latent_fname(1))
    finish_encode(work, tmp_path / "out.zip", ImageFolderDataset(data), 2, {"encoding": "stability-vae"})


def replace_by_fifo(path: Path) -> Path:
    path.unlink()
    return fifo(path)


MEMBERS = {  # a dataset with one member a FIFO, read as its reader reads it; the member the line names
    "shard file": (lambda t: read_all(replace_by_fifo(labeled_shards(t / "d.shards") / shard_name(1)).parent),
                   shard_name(1)),
    "shard file replaced once opened": (shard_replaced_after_opening, shard_name(1)),
    "shard of a resumed shard write": (resumed_shard_write, shard_name(0)),
    "shard index": (lambda t: read_all(replace_by_fifo(labeled_shards(t / "d.shards") / INDEX_FILE).parent),
                    INDEX_FILE),
    "ZIP": (lambda t: read_all(fifo(t / "data.zip")), "data.zip"),
    "dataset.json": (lambda t: read_all(replace_by_fifo(write_image_dataset(t / "data", num=2) / LABELS_FILE).parent),
                     LABELS_FILE),
    ".npy member": (lambda t: read_all(replace_by_fifo(latent_folder(t / "data") / latent_fname(1)).parents[1]),
                    latent_fname(1)),
    "blend spec": (lambda t: read_all(fifo(t / "blend.json")), "blend.json"),
    "latents of a finished encode": (finished_encode, latent_fname(1)),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("member", MEMBERS)
def test_a_fifo_as_any_member_of_any_dataset_format_is_one_line_at_once(member, tmp_path):
    read, name = MEMBERS[member]
    with deadline(10), pytest.raises(EDM2Error) as info:
        read(tmp_path)
    line = str(info.value)
    assert name in line and "a FIFO" in line and "\n" not in line, line


@pytest.mark.bad_input
def test_a_fifo_shard_is_one_line_before_any_training_work(tmp_path):
    data = labeled_shards(tmp_path / "d.shards")
    replace_by_fifo(data / shard_name(2))
    with deadline(30):
        result = CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, f"--data={data}", f"--outdir={tmp_path / 'run'}",
                                                      "--dry-run"])
    assert_one_error_line(result, "--data", shard_name(2), "a FIFO")
    assert not (tmp_path / "run").exists()
