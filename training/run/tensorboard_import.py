"""TensorBoard event files written afterwards from a run's records (stats.jsonl, plots/training.json,
plots/magnitudes.json, samples/grid-*.png), so that runs from before the trackers, or copied from a cluster, can
be browsed too. The file replaces, for TensorBoard's readers, every event RUN/tensorboard/ held before (purge
from step 0); the numbers and tags are those a live run logs (training/run/trackers.py). The events are framed and
written here, in this thread, whole or not at all.
"""

from __future__ import annotations

import math
import os
import socket
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from edm2.data.dataset_files import IMAGE_ERRORS, open_image
from edm2.errors import one_line
from edm2.runtime import files
from training.run.dashboard import (MAGNITUDES_JSON, PLOTS_DIR, TRAINING_JSON, DashboardError, load_records,
                                snapshot_numbers, stats_rows)
from training.run.run_dir import STATS_FILE, load_options
from training.run.sample_grid import grid_path
from training.run.trackers import STATUS_KEYS, TENSORBOARD_DIR, flat_options


def status_rows(run_dir: Path) -> list[dict]:
    """stats.jsonl's rows with an image count and every STATUS_KEYS number; a torn or foreign line is skipped."""
    rows = []
    for row in stats_rows(run_dir, STATUS_KEYS):
        values = {key: float(row[key]) for key in STATUS_KEYS}
        if isinstance(row.get("nimg"), int) and all(map(math.isfinite, values.values())):
            rows.append(dict(values, nimg=row["nimg"]))
    if not rows:
        raise DashboardError(f"{run_dir / STATS_FILE} holds no status rows")
    return rows


def _records(records: dict | None, key: str, path: Path) -> dict[int, dict]:
    """{nimg: row} of the rows under key of a plots/ record file read from path (none when it is missing)."""
    if records is None:
        return {}
    try:
        return {row["nimg"]: row for row in records[key] if isinstance(row["nimg"], int)}
    except (KeyError, TypeError) as e:
        raise DashboardError(f"{path}: malformed records ({type(e).__name__}: {e})") from None


def snapshot_rows(run_dir: Path) -> list[tuple[int, dict]]:
    """(nimg, the numbers a live run logs at that snapshot) for every snapshot with both records."""
    folder = run_dir / PLOTS_DIR
    training, magnitudes = load_records(folder / TRAINING_JSON), load_records(folder / MAGNITUDES_JSON)
    levels = _records(training, "noise_levels", folder / TRAINING_JSON)
    rows = _records(magnitudes, "rows", folder / MAGNITUDES_JSON)
    try:
        sigma = training["sigma"] if levels else []
        return [(nimg, snapshot_numbers(sigma, levels[nimg], rows[nimg]))
                for nimg in sorted(levels.keys() & rows.keys())]
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise DashboardError(f"{folder}: malformed records ({type(e).__name__}: {e})") from None


def _read_png(path: Path) -> np.ndarray:
    """A grid PNG as the HWC array a live run logged (grayscale with one channel); one that declares more pixels
    than an image may have (a decompression bomb) is refused before it is decoded."""
    try:
        with files.open_input(path) as f, open_image(f) as image:
            array = np.asarray(image)
    except IMAGE_ERRORS as e:
        raise DashboardError(f"{path}: not a readable PNG ({one_line(e)})") from None
    return array[:, :, None] if array.ndim == 2 else array


def _events(run_dir: Path, options: dict | None, status: list[dict], snapshots: list[tuple[int, dict]]) -> Iterator:
    """The events TensorBoardTracker logs for these records, as SummaryWriter(purge_step=0) frames them: the file
    version, a start at step 0 (TensorBoard's readers then drop every earlier file's events), the options as
    hyperparameters, then the numbers and grids at their image counts."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    from torch.utils.tensorboard.summary import hparams, image, scalar
    now = time.time()
    yield Event(wall_time=now, step=0, file_version="brain.Event:2")
    yield Event(wall_time=now, step=0, session_log=SessionLog(status=SessionLog.START))
    for summary in hparams(flat_options(options), {}) if options is not None else ():
        yield Event(wall_time=now, summary=summary)
    for row in status:
        for key in STATUS_KEYS:
            yield Event(wall_time=now, step=row["nimg"], summary=scalar(f"train/{key}", row[key]))
    for nimg, numbers in snapshots:
        for tag, value in numbers.items():
            yield Event(wall_time=now, step=nimg, summary=scalar(tag, value))
        grid = grid_path(run_dir, nimg)
        if grid.exists():
            yield Event(wall_time=now, step=nimg, summary=image("samples", _read_png(grid), dataformats="HWC"))


def write_tensorboard(run_dir: str | Path) -> Path:
    """Write RUN/tensorboard/'s event file from the run's records, whole or not at all: every record is read
    first, and the file is written under a temporary name without 'tfevents' (TensorBoard reads every name holding
    it), then renamed. Returns the file; OSError (naming it) when it cannot be written."""
    from tensorboard.summary.writer.record_writer import RecordWriter
    run_dir = Path(run_dir)
    status, snapshots = status_rows(run_dir), snapshot_rows(run_dir)
    options = load_options(run_dir)
    events = list(_events(run_dir, options, status, snapshots))  # every grid read before anything is written
    path = run_dir / TENSORBOARD_DIR / (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                                        f"{os.getpid()}.import")
    with files.atomic_path(path, named="tensorboard-import") as tmp, open(tmp, "wb") as f:
        writer = RecordWriter(f)
        for event in events:
            writer.write(event.SerializeToString())
    return path
