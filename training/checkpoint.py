"""Training-state files and the run's options file: names that never collide, durable saves, newest-valid
lookup, and a bitwise digest of the weights."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Callable

import torch

from edm2 import files
from edm2.errors import EDM2Error
from edm2.snapshot import images_tag, kimg_to_nimg

FORMAT_VERSION = 1
STATE_PATTERN = re.compile(r"^training-state-(\d{7,})(?:-(\d+))?\.pt$")
OPTIONS_FILE = "training_options.json"
REQUIRED_KEYS = ("format_version", "net", "optimizer", "ema", "cur_nimg", "elapsed_s", "options_hash")


class CheckpointError(EDM2Error):
    """A training-state or options file is unreadable or incomplete, or the ranks disagree on the weights."""


def tagged_images(kimg: str, nimg: str | None) -> int:
    """The image count of a name's tag (edm2.snapshot.images_tag); a bare kimg means the multiple of 1024 with
    that kimg, or kimg * 1000 for an older name that has none."""
    if nimg is not None:
        return int(nimg)
    return kimg_to_nimg(int(kimg)) or int(kimg) * 1000


def state_path(run_dir: str | os.PathLike, cur_nimg: int) -> Path:
    """training-state-{images_tag}.pt inside run_dir."""
    return Path(run_dir) / f"training-state-{images_tag(cur_nimg)}.pt"


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
    """Read a training state onto the CPU without running code from the file."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated or foreign files
        raise CheckpointError(f"{path}: unreadable ({e.__class__.__name__}: {str(e).splitlines()[0]})") from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path}: not a training state (missing {', '.join(missing)})")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported format version {state['format_version']}")
    return state


def list_states(run_dir: str | os.PathLike) -> list[Path]:
    """Training-state files of a run, newest (most images) first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(tagged_images(*m.groups()), p) for p in run_dir.iterdir() if (m := STATE_PATTERN.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def load_newest_state(run_dir: str | os.PathLike, report: Callable[[str], None] = print) -> tuple[Path, dict] | None:
    """The newest training state that loads; unreadable newer ones are reported and skipped."""
    for path in list_states(run_dir):
        try:
            return path, load_state(path)
        except CheckpointError as e:
            report(f"Skipping damaged checkpoint: {e}")
    return None


def options_hash(hyperparameters: dict) -> str:
    """SHA-256 of the hyperparameters' canonical JSON."""
    return hashlib.sha256(json.dumps(hyperparameters, sort_keys=True).encode()).hexdigest()


def load_options(run_dir: str | os.PathLike) -> dict | None:
    """The run's training_options.json, or None for a new run."""
    path = Path(run_dir) / OPTIONS_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: unreadable ({e})") from None


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
