"""Training-state files and the run's options file: names that never collide, durable saves, newest-valid
lookup (a state is trusted only when its contents agree with its name and the run's network), and a bitwise
digest of the weights."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
from pathlib import Path
from typing import Callable, Iterable

import torch

from edm2 import bounded_json, files
from edm2.errors import EDM2Error
from edm2.snapshot import images_tag, kimg_to_nimg

FORMAT_VERSION = 1
# training-state-{images_tag}.pt, or .{copy}.pt where the plain name belongs to a state a run refused to read.
STATE_PATTERN = re.compile(r"^training-state-(\d{7,})(?:-(\d+))?(?:\.(\d+))?\.pt$")
OPTIONS_FILE = "training_options.json"
REQUIRED_KEYS = ("format_version", "net", "optimizer", "ema", "cur_nimg", "elapsed_s", "options", "options_hash")


class CheckpointError(EDM2Error):
    """A training-state or options file is unreadable, incomplete or inconsistent, or the ranks disagree on the
    weights."""


class NewerStateError(CheckpointError):
    """A training state written by a newer version of this project (a format version above ours)."""


def tagged_images(kimg: str, nimg: str | None) -> int:
    """The image count of a name's tag (edm2.snapshot.images_tag); a bare kimg means the multiple of 1024 with
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
        state = torch.load(path, map_location="cpu", weights_only=True)
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
    for key in ("net", "optimizer", "ema"):
        if not isinstance(state[key], dict):
            raise CheckpointError(f"{path}: '{key}' is a {type(state[key]).__name__}, not a dictionary")
    if options_hash(state_options(state, path)) != state["options_hash"]:
        raise CheckpointError(f"{path}: its options do not match their hash")
    return state


def state_options(state: dict, path: str | os.PathLike) -> dict:
    """The hyperparameters a training state records (a JSON object), parsed within the bounds of
    edm2.bounded_json."""
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


def load_options(run_dir: str | os.PathLike) -> dict | None:
    """The run's training_options.json (a JSON object within edm2.bounded_json's bounds), or None for a new
    run."""
    return bounded_json.read_object(Path(run_dir) / OPTIONS_FILE, CheckpointError)


def save_options(run_dir: str | os.PathLike, options: dict) -> None:
    """Write training_options.json atomically."""
    with files.atomic_path(Path(run_dir) / OPTIONS_FILE) as tmp:
        tmp.write_text(json.dumps(options, indent=2, sort_keys=True) + "\n")


def weights_digest(net: torch.nn.Module) -> str:
    """SHA-256 of a network's parameters and buffers, bit for bit, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in net.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
