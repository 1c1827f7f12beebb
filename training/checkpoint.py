"""Training-state checkpoints and the run's options: atomic saves, newest-valid lookup, resume checks."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Callable

import torch

from edm2 import files

FORMAT_VERSION = 1
STATE_PATTERN = re.compile(r"^training-state-(\d{7,})\.pt$")
OPTIONS_FILE = "training_options.json"
REQUIRED_KEYS = ("format_version", "net", "optimizer", "ema", "cur_nimg", "elapsed_s", "options_hash")


class CheckpointError(RuntimeError):
    """A training-state file is unreadable or incomplete."""


class OptionsMismatch(ValueError):
    """Resuming with hyperparameters that differ from the run's training_options.json."""


def state_path(run_dir: str | os.PathLike, cur_nimg: int) -> Path:
    """training-state-{kimg:07d}.pt inside run_dir."""
    return Path(run_dir) / f"training-state-{cur_nimg // 1000:07d}.pt"


def save_state(path: str | os.PathLike, state: dict) -> None:
    """Write a training state (plain containers of tensors and numbers) under a temporary name, then rename."""
    with files.atomic_path(path) as tmp:
        torch.save(dict(state, format_version=FORMAT_VERSION), tmp)


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
    """Training-state files of a run, newest (highest kimg) first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := STATE_PATTERN.match(p.name))]
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
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None


def save_options(run_dir: str | os.PathLike, options: dict) -> None:
    """Write training_options.json atomically."""
    with files.atomic_path(Path(run_dir) / OPTIONS_FILE) as tmp:
        tmp.write_text(json.dumps(options, indent=2, sort_keys=True) + "\n")


def check_same_hyperparameters(stored: dict, current: dict, keys: tuple[str, ...]) -> None:
    """Raise OptionsMismatch naming every key in `keys` whose value differs between the two runs."""
    differing = [k for k in keys if stored.get(k) != current.get(k)]
    if differing:
        details = ", ".join(f"{k}: run has {stored.get(k)!r}, now {current.get(k)!r}" for k in differing)
        raise OptionsMismatch(f"cannot resume with different hyperparameters ({details})")


def weights_digest(net: torch.nn.Module) -> str:
    """SHA-256 of a network's parameters and buffers, bit for bit, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in net.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
