"""Inputs that are no regular file (a FIFO waits for a writer forever, a device never ends): every reader of a
user's files refuses them in one line naming the file, at once, through files.open_input."""

import contextlib
import os
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

import generate
import train_edm2
from edm2.data.dataset import ImageFolderDataset
from edm2.data.dataset_files import DatasetError
from edm2.errors import SnapshotError
from edm2.eval import stats_files
from edm2.formats import release_pickle, snapshot
from edm2.procedures.generation import GenerationError, read_generated_labels
from edm2.runtime import bounded_json, files, pinned_files
from training.run import checkpoint, dashboard
from training.run.run_dir import LOCK_FILE
from tests.helpers import TRAIN_ARGS, assert_one_error_line, write_image_dataset


@contextlib.contextmanager
def deadline(seconds: int = 30):
    """Fail (instead of hanging the suite) if the block waits on a FIFO."""
    def expired(signum, frame):
        raise TimeoutError("waited on a FIFO")
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
