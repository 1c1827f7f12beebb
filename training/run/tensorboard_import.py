"""TensorBoard event files written afterwards from a run's records (stats.jsonl, plots/training.json,
plots/magnitudes.json, samples/grid-*.png), so that runs from before the trackers, or copied from a cluster, can
be browsed too. The file replaces, for TensorBoard's readers, every event RUN/tensorboard/ held before (purge
from step 0); the numbers and tags are those a live run logs (training/run/trackers.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import PIL.Image

from training.run.dashboard import (MAGNITUDES_JSON, PLOTS_DIR, TRAINING_JSON, DashboardError, load_records,
                                snapshot_numbers, stats_rows)
from training.run.run_dir import STATS_FILE, load_options
from training.run.sample_grid import grid_path
from training.run.trackers import STATUS_KEYS, TENSORBOARD_DIR, TensorBoardTracker


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
    sigma = training["sigma"] if levels else []
    try:
        return [(nimg, snapshot_numbers(sigma, levels[nimg], rows[nimg]))
                for nimg in sorted(levels.keys() & rows.keys())]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise DashboardError(f"{folder}: malformed records ({type(e).__name__}: {e})") from None


def _read_png(path: Path) -> np.ndarray:
    """A grid PNG as the HWC array a live run logged (grayscale with one channel)."""
    try:
        with PIL.Image.open(path) as image:
            array = np.asarray(image)
    except OSError as e:
        raise DashboardError(f"{path}: not a readable PNG ({e})") from None
    return array[:, :, None] if array.ndim == 2 else array


def write_tensorboard(run_dir: str | Path) -> Path:
    """Write RUN/tensorboard/'s event file from the run's records; every record is read first. Returns the folder."""
    run_dir = Path(run_dir)
    status, snapshots = status_rows(run_dir), snapshot_rows(run_dir)
    options = load_options(run_dir)
    tracker = TensorBoardTracker(run_dir, options, purge_step=0)
    try:
        for row in status:
            tracker.log("status", row["nimg"], {f"train/{key}": row[key] for key in STATUS_KEYS}, {})
        for nimg, numbers in snapshots:
            grid = grid_path(run_dir, nimg)
            tracker.log("snapshot", nimg, numbers, {"samples": _read_png(grid)} if grid.exists() else {})
    finally:
        tracker.close()
    return run_dir / TENSORBOARD_DIR
