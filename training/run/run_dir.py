"""A run directory, owned by one training at a time: its lock, options file, identity, log, stats.jsonl and EMA
snapshots; its training states belong to training/run/checkpoint.py, which decides where a rerun resumes.

A run directory holds only these files: training_options.json, log.txt, stats.jsonl,
network-snapshot-{images_tag}-{std_tag}.safetensors, training-state-{images_tag}.pt (or .{copy}.pt, where a
state of that name was refused: checkpoint.state_path), plots/ (the dashboard's records and PNGs,
training/run/dashboard.py), samples/ (the snapshots' sample grids, training/run/sample_grid.py), with --logger
tensorboard/ and wandb-run.json (training/run/trackers.py), and while a training runs, training.lock
(RunLock: edm2.runtime.locks's kernel lock, naming the host and process holding it and free again the moment that
process ends). Files being written carry temporary names (.NAME.PID@HOST.RANDOM.tmp) until they are
complete; the next training in the folder removes those a killed run left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterator

import torch

from edm2.errors import EDM2Error
from edm2.formats.snapshot import save_network, snapshot_name
from edm2.runtime import bounded_json, files
from edm2.runtime.locks import DestinationLock
from training.run import trackers
from training.options import TrainingOptions
from training.presets import DEFAULT_METHOD
from training.step import recipe_consistency, recipe_loss

LOG_FILE, STATS_FILE, OPTIONS_FILE = "log.txt", "stats.jsonl", "training_options.json"
SNAPSHOT_PREFIX = "network-snapshot"
# A run's identity (uuid4 hex), in its training_options.json, training states and snapshots' metadata.
RUN_ID = re.compile(r"[0-9a-f]{32}")
RUN_ID_KEY = "run_id"  # in training_options.json: the run's identity, beside its options
LOCK_FILE = "training.lock"


class RunLock(DestinationLock):
    """The lock of one run directory on RUN/training.lock (no lock is ever judged stale by its process id);
    `acquire` takes it or raises edm2.runtime.locks.DestinationInUse, `release` gives it back (and deletes
    training.lock)."""

    def __init__(self, run_dir: str | os.PathLike):
        super().__init__(run_dir, "training", LOCK_FILE)


class RunDirectoryError(EDM2Error):
    """A run directory's training_options.json is unreadable, or holds a run identity that is not one."""


def load_options(run_dir: str | os.PathLike) -> dict | None:
    """The run's training_options.json (a JSON object within edm2.runtime.bounded_json's bounds), or None for a
    new run."""
    return bounded_json.read_object(Path(run_dir) / OPTIONS_FILE, RunDirectoryError)


def save_options(run_dir: str | os.PathLike, options: dict) -> None:
    """Write training_options.json atomically."""
    with files.atomic_path(Path(run_dir) / OPTIONS_FILE) as tmp:
        tmp.write_text(json.dumps(options, indent=2, sort_keys=True) + "\n")


def checked_run_id(run_id: object, source: str | os.PathLike, error: type[EDM2Error] = RunDirectoryError) -> str:
    """run_id read from the file source, raising error unless it is a run identity (32 lowercase hex digits)."""
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise error(f"{source}: its run_id {str(run_id)[:40]!r} is not 32 hex digits")
    return run_id


def snapshot_path(run_dir: str | os.PathLike, nimg: int, std: float) -> Path:
    """network-snapshot-{images_tag}-{std_tag}.safetensors inside run_dir."""
    return Path(run_dir) / snapshot_name(SNAPSHOT_PREFIX, nimg, std)


class RunDirectory:
    """Rank 0's hold on a run directory, from taking its lock to giving it back.

    If training fails before its first snapshot or training state, the files this start created and the folders
    it made are removed again, so a bad start leaves nothing behind; only those go, the files while it holds the
    lock. A refused start (another training holds the lock) touches nothing but the empty folders it made.
    """

    def __init__(self, path: str | os.PathLike):
        # Resolved, so that X/new/../run and X/run are one directory to every decision below.
        self.path = Path(path).resolve()
        self.created: list[Path] = []
        self.found: set[str] = set()  # names in the directory when this start took the lock
        # A training state or snapshot, this start's or one it resumes from (training/run/checkpoint.py): files stay.
        self.has_results = False
        self.lock = RunLock(self.path)
        self.run_id: str | None = None  # set by take_identity

    @classmethod
    @contextlib.contextmanager
    def open(cls, path: str | os.PathLike, report: Callable[[str], None] = print) -> Iterator[RunDirectory]:
        """Create the folder if needed, lock it (DestinationInUse if another training holds it) and remove the
        temporaries of earlier, killed runs; on leaving, release the lock and undo a fruitless start."""
        run = cls(path)
        run._make_folders()
        try:
            run.lock.acquire(report)
        except BaseException:
            run._remove_created_folders()
            raise
        try:
            run.found = {p.name for p in run.path.iterdir()}
            for stale in files.remove_stale_temporaries(run.path, owned=True):
                report(f"Removed {stale.name}, left by an interrupted write.")
            yield run
        except BaseException:
            run._remove_if_fruitless()
            raise
        finally:
            run.lock.release()
            if not run.has_results:
                run._remove_created_folders()

    def _make_folders(self) -> None:
        """Create the run directory and its missing parents, remembering which ones this process made."""
        for folder in reversed([self.path, *self.path.parents]):
            try:
                folder.mkdir()
                self.created.append(folder)
            except FileExistsError:
                pass

    def _remove_if_fruitless(self) -> None:
        """Delete the files this start created (those not there when it took the lock) when it produced no
        snapshot or training state; called while the lock is held, so no other training's file can be among them."""
        if self.has_results:
            return
        for name in {OPTIONS_FILE, LOG_FILE, STATS_FILE, trackers.WANDB_FILE} - self.found:
            (self.path / name).unlink(missing_ok=True)
        for name in {trackers.TENSORBOARD_DIR, trackers.WANDB_DIR} - self.found:  # the trackers' logs of this start
            if (self.path / name).is_dir() and not (self.path / name).is_symlink():
                shutil.rmtree(self.path / name, ignore_errors=True)

    def _remove_created_folders(self) -> None:
        """Remove the folders this process created, deepest first, where they are empty."""
        for folder in reversed(self.created):
            with contextlib.suppress(OSError):  # not empty: someone else's files; keep them
                folder.rmdir()

    def take_identity(self, run_id: str | None) -> None:
        """The run's identity: run_id (the training state it resumes from carries it), else training_options.json's
        (a run that wrote snapshots before its first training state), else a new one (a new run, or one begun before
        run ids)."""
        if run_id is None:
            options = load_options(self.path)
            stored = None if options is None else options.get(RUN_ID_KEY)  # load_options: an object or None
            run_id = uuid.uuid4().hex if stored is None else checked_run_id(stored, self.path / OPTIONS_FILE)
        self.run_id = run_id

    def snapshot_options(self) -> dict | None:
        """training_options.json of a run that holds snapshots (one stopped before its first training state), or
        None."""
        stored = load_options(self.path)
        return stored if stored is not None and any(self.path.glob(f"{SNAPSHOT_PREFIX}-*.safetensors")) else None

    def options_json(self, opts: TrainingOptions) -> dict:
        """What training_options.json holds: the options and the run's identity."""
        return {**opts.to_json(), RUN_ID_KEY: self.run_id}

    def write_options(self, opts: TrainingOptions) -> None:
        """Write training_options.json: the options and the run's identity."""
        save_options(self.path, self.options_json(opts))

    def trim_stats(self, cur_nimg: int) -> None:
        """Keep the stats rows up to cur_nimg: drop rows a killed run wrote after its last training state, and
        a line torn by a kill in mid-append. A log file never stops a resume."""
        path = self.path / STATS_FILE
        try:
            data = path.read_bytes() if path.is_file() else b""
        except OSError as e:
            print(f"Cannot read {path} ({e.strerror}); leaving it as it is.")
            return
        rows = [line for line in data.split(b"\n") if line.strip()]
        kept = [line for line in rows if (nimg := _row_images(line)) is not None and nimg <= cur_nimg]
        if kept != rows or not data.endswith(b"\n") and data:
            if len(kept) < len(rows) and _row_images(rows[-1]) is None:
                print(f"Dropped a torn last line of {path}.")
            with files.atomic_path(path) as tmp:
                tmp.write_bytes(b"".join(line + b"\n" for line in kept))

    def append_stats(self, row: dict) -> None:
        """Add one JSON row to stats.jsonl; a failed write (a full disk) leaves no partial row."""
        path, data = self.path / STATS_FILE, memoryview((json.dumps(row) + "\n").encode())
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            size = os.fstat(fd).st_size
            while data:
                data = data[os.write(fd, data):]
        except OSError as e:
            os.ftruncate(fd, size)
            raise OSError(e.errno, e.strerror, str(path)) from None
        finally:
            os.close(fd)

    def save_snapshots(self, tracks: list[tuple[torch.nn.Module, float]], cur_nimg: int, opts: TrainingOptions) -> None:
        """One snapshot file per EMA track (the networks and sigma_rel of the tracker's get()), with the metadata
        generate.py and reconstruct_phema.py read."""
        for ema_net, std in tracks:
            metadata = dict(
                nimg=cur_nimg, ema_std=std, encoder=opts.encoder, dataset=opts.dataset, preset=opts.preset,
                loss=recipe_loss(opts, ema_net.sigma_data).record(), training_options=opts.to_json(), run_id=self.run_id,
            )
            if opts.method != DEFAULT_METHOD:  # a consistency model (edm2.consistency_loss), not a diffusion model
                metadata["consistency"] = recipe_consistency(opts, ema_net.sigma_data).record()
            save_network(snapshot_path(self.path, cur_nimg, std), ema_net, metadata)
        self.has_results = True


def _row_images(line: bytes) -> int | None:
    """The image count of one stats.jsonl line; None for an empty, torn or foreign line (also one beyond
    edm2.runtime.bounded_json's bounds)."""
    try:
        row = bounded_json.parse(line, STATS_FILE)
    except bounded_json.JSONFileError:
        return None
    nimg = row.get("nimg") if isinstance(row, dict) else None
    return nimg if isinstance(nimg, int) else None
