"""Experiment trackers fed by rank 0: TensorBoard (RUN/tensorboard/) and Weights & Biases, through their own
libraries, each an optional extra of the package.

Every number is logged against the images seen: TensorBoard's step is the image count (kimg = step / 1000, as
TensorBoard steps are integers), W&B's x axis is the logged 'kimg'. A resumed run continues the same TensorBoard
directory, purging the events a killed run wrote after its last training state, and the same W&B run (its id
in RUN/wandb-run.json, with the image count each group of numbers was last logged at, so none is logged twice).
A tracker that raises, calls sys.exit, or fails in a thread of its own (TensorBoard writes its event file from
one: a full or read-only disk) is dropped with one warning line and no traceback: training never stops for it.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import uuid
from pathlib import Path

import numpy as np

from edm2.errors import EDM2Error, one_line
from edm2.runtime import bounded_json, files
from training.options import TRACKERS

_MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}
# The packages whose threads belong to each tracker: an exception ending one of them is that tracker's failure.
_THREAD_PACKAGES = {"tensorboard": ("tensorboard", "torch.utils.tensorboard"), "wandb": ("wandb",)}
TENSORBOARD_DIR = "tensorboard"
WANDB_FILE = "wandb-run.json"
WANDB_DIR = "wandb"  # W&B's own files, in the run directory unless $WANDB_DIR says elsewhere
WANDB_PROJECT = "edm2"  # unless WANDB_PROJECT is set
# stats.jsonl's columns that every status line logs, under 'train/'.
STATUS_KEYS = ("loss", "lr", "images_per_s", "sec_per_kimg", "tflops", "mfu", "max_memory_gb")


class TrackerUnavailable(EDM2Error):
    """A tracker whose library (the package extra of the same name) is not installed."""


def check_installed(name: str) -> None:
    """Raise TrackerUnavailable unless the library of tracker `name` imports."""
    try:
        importlib.import_module(_MODULES[name])
    except ImportError:
        raise TrackerUnavailable(f"{name} is not installed: pip install -e .[{name}]") from None


def flat_options(options: dict, prefix: str = "") -> dict[str, bool | int | float | str]:
    """Options as hyperparameters: nested dicts flattened to 'a/b' keys, lists and None as JSON text."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in options.items():
        if isinstance(value, dict):
            flat.update(flat_options(value, f"{prefix}{key}/"))
        else:
            flat[prefix + key] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
    return flat


class TensorBoardTracker:
    """Event files in RUN/tensorboard/, one per invocation; steps are images seen."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, options: dict | None, purge_step: int):
        """TensorBoard's readers drop the events of earlier files at steps >= purge_step; options, when given, are
        written as the hyperparameters."""
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams
        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=purge_step)
        if options is not None:
            for summary in hparams(flat_options(options), {}):
                self.writer.file_writer.add_summary(summary)

    def log(self, group: str, nimg: int, scalars: dict[str, float], images: dict[str, np.ndarray]) -> None:
        """Add scalars and HWC uint8 images at step nimg."""
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, nimg)
        for tag, image in images.items():
            self.writer.add_image(tag, image, nimg, dataformats="HWC")

    def flush(self) -> None:
        """Write the queued events to disk."""
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class WandbTracker:
    """One W&B run per run directory, resumed by the id kept in RUN/wandb-run.json."""

    name = "wandb"

    def __init__(self, run_dir: Path, options: dict):
        import wandb
        self.wandb, self.record_path = wandb, run_dir / WANDB_FILE
        record = bounded_json.read(self.record_path) if self.record_path.exists() else {}
        if not (isinstance(record, dict) and isinstance(record.get("id"), str)
                and isinstance(record.get("logged"), dict)):
            record = dict(id=uuid.uuid4().hex[:12], logged={})
        self.record = record
        self._save_record()
        self.run = wandb.init(id=record["id"], resume="allow", project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT),
                              name=run_dir.name, config=options, dir=None if os.environ.get("WANDB_DIR") else run_dir)
        self.run.define_metric("kimg")
        self.run.define_metric("*", step_metric="kimg")

    def _save_record(self) -> None:
        """Write the run id and the image counts logged so far, atomically."""
        with files.atomic_path(self.record_path) as tmp:
            tmp.write_text(json.dumps(self.record))

    def log(self, group: str, nimg: int, scalars: dict[str, float], images: dict[str, np.ndarray]) -> None:
        """Log scalars and images at kimg = nimg / 1000, unless this group was logged at nimg or later already."""
        logged = self.record["logged"]
        if isinstance(logged.get(group), int) and logged[group] >= nimg:
            return
        row = dict(scalars, kimg=nimg / 1000)
        row.update({tag: self.wandb.Image(image) for tag, image in images.items()})
        self.run.log(row)
        logged[group] = nimg
        self._save_record()

    def flush(self) -> None:
        """Nothing to do: W&B's own process writes as it receives."""

    def close(self) -> None:
        """Finish the W&B run."""
        self.run.finish()


def _thread_tracker(thread: threading.Thread | None) -> str | None:
    """The tracker whose library runs this thread (its class's or its target's package), or None."""
    modules = [type(thread).__module__, getattr(getattr(thread, "_target", None), "__module__", None) or ""]
    return next((name for name, packages in _THREAD_PACKAGES.items()
                 if any(m == p or m.startswith(p + ".") for m in modules for p in packages)), None)


def _thread_failed(args: threading.ExceptHookArgs) -> None:
    """threading.excepthook: a tracker's thread that fails is the current Trackers' one warning line, not a
    traceback; any other thread's failure goes to the hook that was there before."""
    name = _thread_tracker(args.thread)
    if name is None or _current is None:
        _previous_hook(args)
    elif not isinstance(args.exc_value, SystemExit):  # SystemExit ends a thread quietly, as Python's own hook has it
        _current.warn(name, args.exc_value)


_previous_hook = threading.excepthook
_current: Trackers | None = None  # the Trackers that warn for failed tracker threads: the newest


class Trackers:
    """The trackers of a run, each dropped with one warning line when it raises, calls sys.exit or fails in its
    own thread."""

    def __init__(self, names: tuple[str, ...], run_dir: Path, options: dict, cur_nimg: int):
        global _current, _previous_hook
        self.trackers: list = []
        self.failed: set[str] = set()  # trackers warned about, dropped at the next call
        self._lock = threading.Lock()  # warn() runs in the trackers' threads too
        _current = self
        if threading.excepthook is not _thread_failed:
            _previous_hook, threading.excepthook = threading.excepthook, _thread_failed
        # A resumed run drops what a killed run logged after the training state it resumes from; the options are
        # logged once, by the run's first invocation.
        makers = dict(tensorboard=lambda: TensorBoardTracker(run_dir, None if cur_nimg else options, cur_nimg + 1),
                      wandb=lambda: WandbTracker(run_dir, options))
        for name in names:
            tracker = self._guarded(name, makers[name])
            if tracker is not None:
                self.trackers.append(tracker)

    def warn(self, name: str, error: BaseException) -> None:
        """The one warning line of a failed tracker (once, from whichever thread sees the failure first)."""
        with self._lock:
            if name in self.failed:
                return
            self.failed.add(name)
        print(f"Warning: the {name} tracker failed ({type(error).__name__}: {one_line(error)}); training goes on "
              f"without it.", flush=True)

    def _guarded(self, name: str, fn):
        """fn()'s result, or None after one warning line when it raises or calls sys.exit."""
        try:
            return fn()
        except (Exception, SystemExit) as e:  # a tracker's library may raise, or exit, anything; training goes on
            self.warn(name, e)
            return None

    def _each(self, method: str, *args) -> None:
        """Call a method of every tracker; drop those that raise or have failed in their threads."""
        kept = []
        for tracker in self.trackers:
            if tracker.name not in self.failed and self._guarded(
                    tracker.name, lambda t=tracker: getattr(t, method)(*args) or True):
                kept.append(tracker)
        self.trackers = [tracker for tracker in kept if tracker.name not in self.failed]

    def log(self, group: str, nimg: int, scalars: dict[str, float],
            images: dict[str, np.ndarray] | None = None) -> None:
        """Log a group of numbers (and HWC uint8 images) at nimg images seen."""
        self._each("log", group, nimg, scalars, images or {})

    def flush(self) -> None:
        """Get what was logged onto disk (before a training state, so a resume misses nothing)."""
        self._each("flush")

    def close(self) -> None:
        """Close every tracker."""
        self._each("close")
        self.trackers = []
