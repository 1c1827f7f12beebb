"""What a run writes to disk: snapshot and training-state sizes computed from the network, and the start line
that sets the run's output against the free space where it writes."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from edm2.data.toy_shapes import SHAPES
from training.options import TrainingOptions
from training.presets import DEFAULT_METHOD, IMG64, IMG512, TOY, get_preset
from training.state import init_network

# What each preset's default data holds: (resolution, channels stored, network channels, labels); img512's
# stored latents carry mean and std of the VAE's four channels.
PRESET_DATA = {IMG512: (64, 8, 4, 1000), IMG64: (64, 3, 3, 1000), TOY: (16, 3, 3, len(SHAPES))}

# A bound on the bytes of a file besides its tensors: safetensors' JSON header (tensor names, the run's options)
# or torch.save's zip records (about 200 bytes per tensor, each aligned to 64 bytes), plus a fixed allowance.
FIXED_OVERHEAD, PER_TENSOR_OVERHEAD = 64 * 1024, 512


def snapshot_bytes(net: torch.nn.Module) -> int:
    """Tensor bytes of one EMA snapshot: floating-point tensors as float16, the others as they are."""
    return sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in net.state_dict().values())


def state_bytes(net: torch.nn.Module, num_tracks: int) -> int:
    """Tensor bytes of one training state: the float32 network and its EMA tracks, and Adam's two float32 moments
    per parameter."""
    tensors = sum(t.numel() * (4 if t.is_floating_point() else t.element_size()) for t in net.state_dict().values())
    return (1 + num_tracks) * tensors + 2 * 4 * sum(p.numel() for p in net.parameters())


def overhead_bound(net: torch.nn.Module, num_tracks: int) -> int:
    """The most bytes a snapshot or training state holds beyond its tensors."""
    tensors = len(net.state_dict())
    # A training state's tensors: the network's, each track's, and per parameter Adam's two moments and step.
    return FIXED_OVERHEAD + PER_TENSOR_OVERHEAD * tensors * (1 + num_tracks + 3)


def writes(start: int, end: int, interval: int) -> int:
    """How many files an output written at each multiple of interval in (start, end], and always at end, makes."""
    if start >= end:
        return 0
    crossings = end // interval - start // interval if interval > 0 else 0
    return crossings + (interval <= 0 or end % interval != 0)


def size_text(num_bytes: float) -> str:
    """Bytes in binary units, e.g. '1.5 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def disk_report(opts: TrainingOptions, net: torch.nn.Module, start: int, run_dir: Path) -> tuple[str, str | None]:
    """The start line saying what the run writes from start images on and how much is free where it writes, and a
    warning when that output cannot fit (None when it can)."""
    tracks = len(opts.ema_stds)
    snapshot, state = snapshot_bytes(net), state_bytes(net, tracks)  # headers add under overhead_bound: negligible
    num_snapshots = writes(start, opts.duration, opts.snapshot) * tracks
    num_states = writes(start, opts.duration, opts.checkpoint)
    # With --keep-states=N the newest N stay, plus the one being written before an older one is deleted.
    held_states = min(num_states, opts.keep_states + 1) if opts.keep_states else num_states
    needed = num_snapshots * snapshot + held_states * state
    free = shutil.disk_usage(run_dir).free
    kept = f", at most {held_states} on disk at once" if held_states < num_states else ""
    line = (f"Disk: this run writes {num_snapshots} snapshot(s) of {size_text(snapshot)} and {num_states} training "
            f"state(s) of {size_text(state)}{kept}: up to {size_text(needed)}; {size_text(free)} free in "
            f"{run_dir}")
    warning = None
    if needed > free:
        warning = (f"Warning: the run's output ({size_text(needed)}) does not fit in the {size_text(free)} free in "
                   f"{run_dir}; a larger --snapshot interval or --keep-states=1 writes less")
    return line, warning


def preset_sizes(preset: str) -> tuple[int, int]:
    """(snapshot, training state) tensor bytes of a preset trained on its default data, from its network built
    on the meta device (no memory, no time)."""
    resolution, stored, img_channels, labels = PRESET_DATA[get_preset(preset).data]
    # A consistency student's network, optimizer and EMA are its teacher's network's: sized as a diffusion run of it.
    opts = TrainingOptions.from_preset(preset, dict(resolution=resolution, num_channels=stored, label_dim=labels), {},
                                       method=DEFAULT_METHOD, tangent_warmup_Mimg=0.0)
    with torch.device("meta"):
        net = init_network(opts, img_channels)
    return snapshot_bytes(net), state_bytes(net, len(opts.ema_stds))
