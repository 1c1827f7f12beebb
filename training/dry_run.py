"""What a training would do, for --dry-run: the network's size and where the run would start or resume."""

from __future__ import annotations

import os

import torch

from edm2.networks import count_parameters
from training import checkpoint
from training.options import TrainingOptions
from training.state import init_network


def parameter_count(opts: TrainingOptions, img_channels: int) -> int:
    """Trainable parameters of the network the options describe, built on the meta device (no memory, no time)."""
    with torch.device("meta"):
        return count_parameters(init_network(opts, img_channels))


def start_or_resume(run_dir: str | os.PathLike, duration: int) -> str:
    """Where a training in run_dir would begin: a new run, or the newest training state found there."""
    states = checkpoint.list_states(run_dir)
    if not states:
        return f"Would start a new run in {run_dir} (no training state there)."
    images = checkpoint.tagged_images(*checkpoint.STATE_PATTERN.match(states[0].name).groups())
    if images >= duration:
        return f"Would stop at once: {states[0]} already holds {images} >= {duration} images."
    return (f"Would resume from {states[0]} at {images} of {duration} images (the newest training state; a "
            "damaged one falls back to the one before).")
