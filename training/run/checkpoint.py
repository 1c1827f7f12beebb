"""The one owner of a run's training states (training-state-*.pt): Checkpoints saves them, finds the newest valid
one, verifies it (its contents agree with its name, its hyperparameters with the run's options, its tensors with the
network) and loads it; below it, the file format: names that never collide, durable saves, whole-file checks, and
a bitwise digest of the weights."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Callable, Iterable

import torch

from edm2.errors import EDM2Error
from edm2.formats.snapshot import images_tag, kimg_to_nimg
from edm2.runtime import bounded_json, distributed, files
from training.data_order import ORDERS
from training.data_record import is_record
from training.options import OptionsMismatch, TrainingOptions, check_same_hyperparameters
from training.run.run_dir import RUN_ID_KEY, RunDirectory, checked_run_id
from training.state import TrainingState, state_nonfinite

FORMAT_VERSION = 1
# training-state-{images_tag}.pt, or .{copy}.pt where the plain name belongs to a state a run refused to read.
STATE_PATTERN = re.compile(r"^training-state-(\d{7,})(?:-(\d+))?(?:\.(\d+))?\.pt$")
REQUIRED_KEYS = ("format_version", "net", "optimizer", "ema", "cur_nimg", "elapsed_s", "options", "options_hash")


class CheckpointError(EDM2Error):
    """A training-state file is unreadable, incomplete or inconsistent, or the ranks disagree on the weights."""


class NewerStateError(CheckpointError):
    """A training state written by a newer version of this project (a format version above ours)."""


class Checkpoints:
    """A run's training states, on every rank: rank 0 holds the run directory and reads and writes the files; the
    other ranks (run None) take part in the collectives and read the state rank 0 chose."""

    def __init__(self, run: RunDirectory | None):
        self.run = run
        self.refused: set[str] = set()  # training states this start skipped: never replaced, never pruned
        self.left: set[str] = set()  # names of training states that are no file of ours, each reported once

    def resume(self, state: TrainingState, opts: TrainingOptions) -> Path | None:
        """Every rank: continue state from the run's newest valid training state and return its path, or leave the
        state new and return None; rank 0 chooses it (newest), the other ranks read the file it names."""
        path, saved = distributed.on_main_rank(
            lambda: self.newest(opts, lambda contents, file: check_fits(state, contents, file))) or (None, None)
        path = distributed.broadcast_object(path)
        if path and saved is None:
            saved = load_state(path)
        if saved is not None:
            state.load(saved)
        return path

    def newest(self, opts: TrainingOptions, check: Callable[[dict, Path], None]) -> tuple[Path | None, dict | None]:
        """Rank 0: the training state to resume from (path, contents): the newest one whose hyperparameters are the
        run's (OptionsMismatch otherwise) and which passes check (that its tensors fit the network); newer ones that
        are damaged, inconsistent or from a newer version are skipped with a line each, and never replaced. Settles
        the run's identity; a run with snapshots but no training state must keep its training_options.json's
        hyperparameters."""

        def fits(contents: dict, path: Path) -> None:
            check_same_hyperparameters(state_options(contents, path), opts.hyperparameters())
            check(contents, path)

        try:
            found, skipped = load_newest_state(self.run.path, check=fits, report=print)
            self.refused = {path.name for path in skipped}
            self.run.take_identity(_run_id(found))
            if found is not None:
                self.run.has_results = True
                return found
            stored = self.run.snapshot_options()
            if stored is not None:
                check_same_hyperparameters(stored, opts.to_json())
                self.run.has_results = True
        except OptionsMismatch as e:
            raise OptionsMismatch(f"{self.run.path}: {e}") from None
        return None, None

    def save(self, state: TrainingState, opts: TrainingOptions) -> None:
        """Every rank: hash the weights, so that the file records that the ranks agree; then rank 0 writes the
        training state and, with --keep-states, deletes the older ones beyond it."""
        digests = distributed.all_gather_object(weights_digest(state.net))
        if len(set(digests)) != 1:
            raise CheckpointError(f"ranks hold different weights at {state.cur_nimg} images: {digests}")
        contents = state.to_dict()  # on every rank: a sharded EMA gathers its tracks on rank 0
        if self.run is None:
            return
        hyperparameters = opts.hyperparameters()
        path = self.write(dict(contents, options=json.dumps(hyperparameters, sort_keys=True),
                               options_hash=options_hash(hyperparameters), rank_digests=digests))
        print(f"Saved {path.name}", flush=True)
        if opts.keep_states:
            for old in self.prune(path, opts.keep_states):
                print(f"Deleted {old.name} (--keep-states={opts.keep_states})", flush=True)

    def write(self, contents: dict) -> Path:
        """Rank 0: write a training state named by its image count (by another name where that one belongs to a
        state this start refused to read), stamped with the run's identity; returns its path."""
        path = state_path(self.run.path, contents["cur_nimg"], avoid=self.refused)
        save_state(path, dict(contents, run_id=self.run.run_id))
        self.run.has_results = True
        return path

    def prune(self, newest: Path, keep: int) -> list[Path]:
        """Rank 0: delete the run's training states beyond the keep newest, once newest (just written) reads back
        whole; states this start refused to read are not ours to judge and stay, and so does anything of a state's name
        that is not a regular file (a directory, a link), said once. Returns the deleted paths."""
        load_state(newest)  # a kill or a bad disk must never leave us with no readable state
        named = [p for p in list_states(self.run.path) if p.name not in self.refused]
        ours = [p for p in named if _regular_file(p)]
        for other in [p for p in named if p not in ours and p.name not in self.left]:
            print(f"Leaving {other.name}: named like a training state but no regular file (--keep-states deletes only "
                  "training-state files)", flush=True)
            self.left.add(other.name)
        if newest not in ours[:keep]:
            return []
        for old in ours[keep:]:
            old.unlink(missing_ok=True)
        return ours[keep:]


def _regular_file(path: Path) -> bool:
    """Whether path itself (not what a link names) is a regular file; False when it is gone."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except FileNotFoundError:
        return False


def _run_id(found: tuple[Path, dict] | None) -> str | None:
    """The run identity the training state found carries; None where none was found or it predates run ids."""
    if found is None or RUN_ID_KEY not in found[1]:
        return None
    return checked_run_id(found[1][RUN_ID_KEY], found[0], CheckpointError)


def check_fits(state: TrainingState, saved: dict, path: str | os.PathLike) -> None:
    """Raise CheckpointError naming the first tensor of a training state (read by load_state) that does not fit
    state's network, Adam or EMA tracks: a missing or extra name, another shape, NaN or infinity, or an impossible
    Adam moment (training.state.state_nonfinite)."""
    shapes = {name: tensor.shape for name, tensor in state.net.state_dict().items()}
    _check_tensors(saved["net"], shapes, path, "net")
    stds, emas = saved["ema"].get("stds"), saved["ema"].get("emas")
    if not isinstance(stds, list) or tuple(stds) != state.ema.stds or not isinstance(emas, list) \
            or len(emas) != len(stds):
        raise CheckpointError(f"{path}: its EMA tracks are not those of sigma_rel {list(state.ema.stds)}")
    for index, ema in enumerate(emas):
        _check_tensors(ema, shapes, path, f"ema track {index}")
    groups = saved["optimizer"].get("param_groups")
    params = [p for group in state.optimizer.param_groups for p in group["params"]]
    if not isinstance(groups, list) or [len(g.get("params", ())) if isinstance(g, dict) else None for g in groups] \
            != [len(g["params"]) for g in state.optimizer.param_groups]:
        raise CheckpointError(f"{path}: its optimizer holds other parameter groups than the network's")
    moments = saved["optimizer"].get("state")
    if not isinstance(moments, dict) or not set(moments) <= set(range(len(params))):
        raise CheckpointError(f"{path}: its optimizer state names parameters the network does not have")
    for index, moment in moments.items():
        expected = {"step": torch.Size([]), "exp_avg": params[index].shape, "exp_avg_sq": params[index].shape}
        _check_tensors(moment, expected, path, f"optimizer state {index}")
    # A diverged training's state, or a damaged one: resuming it would write NaN snapshots.
    problem = state_nonfinite(saved["net"], saved["optimizer"], zip(stds, emas),
                              [name for name, _ in state.net.named_parameters()])
    if problem:
        raise CheckpointError(f"{path}: {problem}")


def _check_tensors(saved: object, shapes: dict[str, torch.Size], path: str | os.PathLike, what: str) -> None:
    """Raise CheckpointError unless saved maps exactly the names of shapes to tensors of those shapes."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: its {what} is a {type(saved).__name__}, not tensors by name")
    missing, extra = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
    if missing or extra:
        problem = f"lacks {missing[0]}" if missing else f"has an unknown {extra[0]}"
        raise CheckpointError(f"{path}: its {what} {problem}")
    for name, shape in shapes.items():
        tensor = saved[name]
        if not isinstance(tensor, torch.Tensor) or tensor.shape != shape:
            found = f"shape {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise CheckpointError(f"{path}: {what} {name} has {found}, the network's has shape {list(shape)}")


def tagged_images(kimg: str, nimg: str | None) -> int:
    """The image count of a name's tag (edm2.formats.snapshot.images_tag); a bare kimg means the multiple of 1024 with
    that kimg, or kimg * 1000 for an older name that has none."""
    if nimg is not None:
        return int(nimg)
    return kimg_to_nimg(int(kimg)) or int(kimg) * 1000


def state_path(run_dir: str | os.PathLike, cur_nimg: int, avoid: Iterable[str] = ()) -> Path:
    """training-state-{images_tag}.pt inside run_dir; where that name is in avoid (files a run refused to read,
    which are never replaced), training-state-{images_tag}.{copy}.pt with the first copy number not in avoid."""
    avoid, tag, copy = set(avoid), images_tag(cur_nimg), 0
    name = f"training-state-{tag}.pt"
    while name in avoid:
        copy += 1
        name = f"training-state-{tag}.{copy}.pt"
    return Path(run_dir) / name


class _WriteErrors(io.RawIOBase):
    """A binary file that keeps the OSError behind torch.save's generic RuntimeError (a full disk, say)."""

    def __init__(self, f: io.BufferedWriter):
        super().__init__()
        self.f, self.error = f, None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise


def save_state(path: str | os.PathLike, state: dict) -> None:
    """Write a training state (plain containers of tensors and numbers) durably under a temporary name, then
    rename it; a failed write raises OSError naming path and leaves nothing behind."""
    try:
        with files.atomic_path(path) as tmp, open(tmp, "wb") as f:
            writer = _WriteErrors(f)
            try:
                torch.save(dict(state, format_version=FORMAT_VERSION), writer)
            except RuntimeError:
                if writer.error is None:
                    raise
                raise writer.error from None
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def load_state(path: str | os.PathLike) -> dict:
    """Read a training state onto the CPU without running code from the file, and check that it is whole: every
    entry present, of its type, the images it holds those its name says, its options valid and matching their hash.
    NewerStateError for a newer format version; CheckpointError for anything else amiss."""
    path = Path(path)
    try:
        with files.open_input(path) as f:  # a FIFO or device is refused, not waited on
            state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated or foreign files
        raise CheckpointError(f"{path}: unreadable ({e.__class__.__name__}: {str(e).splitlines()[0]})") from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path}: not a training state (missing {', '.join(missing)})")
    version = state["format_version"]
    if _is_int(version) and version > FORMAT_VERSION:
        raise NewerStateError(f"{path}: written by a newer version of this project (format version {version}; "
                              f"this one reads {FORMAT_VERSION})")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported format version {version!r}")
    nimg, elapsed = state["cur_nimg"], state["elapsed_s"]
    if not _is_int(nimg) or nimg < 0:
        raise CheckpointError(f"{path}: images seen {nimg!r} is not a count")
    match = STATE_PATTERN.match(path.name)
    if match and (nimg // 1000 != int(match[1]) or match[2] is not None and nimg != int(match[2])):
        named = f"{match[2]} images" if match[2] is not None else f"kimg {int(match[1])}"  # older names: kimg alone
        raise CheckpointError(f"{path}: holds {nimg} images, but its name says {named}")
    if not isinstance(elapsed, (int, float)) or isinstance(elapsed, bool) or not math.isfinite(elapsed) or elapsed < 0:
        raise CheckpointError(f"{path}: training time {elapsed!r} is not a duration")
    if state.get("data_order", "permutation") not in ORDERS:
        raise CheckpointError(f"{path}: data order {state['data_order']!r} is none of {', '.join(ORDERS)}")
    if state.get("data") is not None and not is_record(state["data"]):
        raise CheckpointError(f"{path}: its record of the data is not one training.data_record writes")
    for key in ("net", "optimizer", "ema"):
        if not isinstance(state[key], dict):
            raise CheckpointError(f"{path}: '{key}' is a {type(state[key]).__name__}, not a dictionary")
    if options_hash(state_options(state, path)) != state["options_hash"]:
        raise CheckpointError(f"{path}: its options do not match their hash")
    return state


def state_options(state: dict, path: str | os.PathLike) -> dict:
    """The hyperparameters a training state records (a JSON object), parsed within the bounds of
    edm2.runtime.bounded_json."""
    if not isinstance(state.get("options"), str):
        raise CheckpointError(f"{path}: its options are not JSON text")
    try:
        options = bounded_json.parse(state["options"], f"{path} (options)")
    except bounded_json.JSONFileError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(options, dict):
        raise CheckpointError(f"{path}: its options are a JSON {type(options).__name__}, not an object")
    return options


def list_states(run_dir: str | os.PathLike) -> list[Path]:
    """Training-state files of a run, newest (most images, then the highest copy) first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(tagged_images(m[1], m[2]), int(m[3] or 0), p) for p in run_dir.iterdir()
             if (m := STATE_PATTERN.match(p.name))]
    return [p for *_, p in sorted(found, reverse=True)]


def load_newest_state(run_dir: str | os.PathLike, check: Callable[[dict, Path], None] = lambda state, path: None,
                      report: Callable[[str], None] = print) -> tuple[tuple[Path, dict] | None, list[Path]]:
    """(path, state) of the newest training state that loads and passes check (which raises CheckpointError
    for a state that does not fit the run), or None; and the newer states skipped, each reported with why."""
    skipped = []
    for path in list_states(run_dir):
        try:
            state = load_state(path)
            check(state, path)
            return (path, state), skipped
        except CheckpointError as e:
            report(f"Skipping training state {e}")
            skipped.append(path)
    return None, skipped


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def options_hash(hyperparameters: dict) -> str:
    """SHA-256 of the hyperparameters' canonical JSON."""
    return hashlib.sha256(json.dumps(hyperparameters, sort_keys=True).encode()).hexdigest()


def weights_digest(net: torch.nn.Module) -> str:
    """SHA-256 of a network's parameters and buffers, bit for bit, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in net.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
