"""Post-hoc EMA for any PyTorch model (paper Section 3, Appendix C): track, store, synthesize afterwards.

For a plain nn.Module trained by any loop. PostHocEMA tracks power-function EMA profiles of the module with
the same tracker as our training (edm2.phema.PowerFunctionEMA) and stores them at intervals as
`{folder}/{prefix}-{step:09d}-{std_tag(std)}.safetensors`: the module's state dict (floating tensors in a chosen
dtype, float32 by default) plus JSON metadata under the key 'edm2-ema'. synthesize() solves the least-squares
weights of Algorithm 3 and combines the stored tracks with edm2.procedures.posthoc.combine, the code
reconstruct_phema.py runs, into an EMA of any length.

Time is counted in optimizer steps: the paper's t is any monotone counter (our training counts images), and
sigma_rel is relative to it, so only the ratios of times matter. update(step) after step `step` folds in the
module's weights with the decay of Eq. 127 for the steps since the previous call.

Parameters are averaged; buffers (BatchNorm's running statistics, step counters) are not, but copied from the
module when a track is saved, as the release does, and a synthesized state dict holds the newest input's.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import safetensors
import safetensors.torch
import torch

from edm2 import phema
from edm2.errors import EDM2Error, SnapshotError
from edm2.procedures import posthoc
# read_metadata checks the version
from edm2.formats.snapshot import FORMAT_VERSION, STD_TAG, WEIGHT_DTYPES, read_metadata, save_state, std_tag

METADATA_KEY = "edm2-ema"
MAX_STEP = 2**53  # exact as a float64, as any JSON reader holds numbers
_DTYPES = {str(t).removeprefix("torch."): t for t in WEIGHT_DTYPES}
_STORED_DTYPES = (*WEIGHT_DTYPES, torch.int64, torch.int32, torch.uint8, torch.bool)


class AnyEMAError(EDM2Error):
    """A bad step or sigma_rel, or stored EMA files that cannot be read (posthoc.PosthocError: combined)."""


def file_name(prefix: str, step: int, std: float) -> str:
    """The name PostHocEMA.save gives the track of sigma_rel `std` after `step` steps."""
    return f"{prefix}-{step:09d}-{std_tag(std)}.safetensors"


class PostHocEMA:
    """Power-function EMA tracks of any module, one float32 copy per sigma_rel, saved for post-hoc synthesis."""

    def __init__(self, module: torch.nn.Module, stds: Sequence[float] = (0.05, 0.10)):
        names = [std_tag(float(s)) for s in stds]
        if not names or len(set(names)) != len(names):
            raise AnyEMAError(f"need distinct sigma_rel values (to 3 decimals, as file names hold them), got {stds}")
        self.tracker = phema.PowerFunctionEMA(module, tuple(stds))
        self.step = 0

    def update(self, step: int) -> None:
        """Fold in the module's weights after optimizer step `step` (1, 2, ...; calls may skip steps)."""
        if not isinstance(step, int) or not self.step < step < MAX_STEP:
            raise AnyEMAError(f"step must be an integer after the previous update ({self.step}), got {step!r}")
        self.tracker.update(step, step - self.step)
        self.step = step

    def get(self) -> list[tuple[torch.nn.Module, float]]:
        """The averaged modules with their sigma_rel, buffers copied from the module."""
        return self.tracker.get()

    def save(self, folder: str | os.PathLike, prefix: str = "ema", dtype: torch.dtype = torch.float32) -> list[Path]:
        """Write each track as of the last update to folder/file_name(prefix, step, std); returns the paths."""
        if self.step == 0:
            raise AnyEMAError("nothing to save before the first update()")
        if dtype not in WEIGHT_DTYPES:
            raise AnyEMAError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype}")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for ema, std in self.get():
            state = ema.state_dict()
            buffers = sorted(name for name, _ in ema.named_buffers() if name in state)
            meta = {"format_version": FORMAT_VERSION, "step": self.step, "std": std, "stds": list(self.tracker.stds),
                    "time": "optimizer steps", "buffers": buffers}
            paths.append(folder / file_name(prefix, self.step, std))
            save_state(paths[-1], state, meta, METADATA_KEY, dtype)
        return paths

    def state_dict(self) -> dict:
        """Everything needed to resume tracking exactly (tensors, floats and the last step)."""
        return dict(self.tracker.state_dict(), step=self.step)

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned; the sigma_rel values must match."""
        self.tracker.load_state_dict(state)
        self.step = int(state["step"])


def _describe(path: Path) -> tuple[int, float, list[str]]:
    """Step, sigma_rel and buffer names of a stored track, from its header."""
    try:
        meta = read_metadata(path, METADATA_KEY, "a post-hoc EMA track")
    except SnapshotError as e:
        raise AnyEMAError(str(e)) from None
    step, std, buffers = meta.get("step"), meta.get("std"), meta.get("buffers")
    if type(step) is not int or not 0 < step < MAX_STEP:
        raise AnyEMAError(f"{path}: metadata 'step' must be an integer in [1, 2**53), got {step!r}")
    if type(std) not in (int, float) or not 0 < std < phema.MAX_STD:
        raise AnyEMAError(f"{path}: metadata 'std' must be a sigma_rel in (0, {phema.MAX_STD:.4f}), got {std!r}")
    if not isinstance(buffers, list) or not all(isinstance(b, str) for b in buffers):
        raise AnyEMAError(f"{path}: metadata 'buffers' must be a list of tensor names")
    return step, float(std), buffers


def _load(path: Path, buffers: list[str]) -> tuple[torch.nn.Module, dict]:
    """A stored track as a module whose parameters are its averaged tensors (float32) and the rest buffers."""
    try:
        state = safetensors.torch.load_file(str(path))
    except (OSError, safetensors.SafetensorError) as e:
        raise AnyEMAError(f"{path}: cannot read tensors: {e}") from None
    if not set(buffers) <= set(state):
        raise AnyEMAError(f"{path}: metadata names buffers the file does not hold")
    root = torch.nn.Module()
    for name, tensor in sorted(state.items()):
        if tensor.dtype not in _STORED_DTYPES:
            raise AnyEMAError(f"{path}: tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}, not a weight")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise AnyEMAError(f"{path}: tensor {name!r} is not finite (NaN or infinity)")
        if name not in buffers and not tensor.is_floating_point():
            raise AnyEMAError(f"{path}: tensor {name!r} is averaged but not floating-point")
        *parents, leaf = name.split(".")
        owner = root
        try:
            for part in parents:
                if part not in owner._modules:
                    owner.add_module(part, torch.nn.Module())  # refuses a name a tensor already has
                owner = owner._modules[part]
            if name in buffers:
                owner.register_buffer(leaf, tensor.float() if tensor.is_floating_point() else tensor)
            else:
                owner.register_parameter(leaf, torch.nn.Parameter(tensor.float(), requires_grad=False))
        except (KeyError, AttributeError, TypeError) as e:
            raise AnyEMAError(f"{path}: tensor name {name!r} does not fit a module ({e})") from None
    return root, {}


def _tracks(folder: Path, prefix: str) -> list[posthoc.Track]:
    """Every stored track of `prefix` in folder, sorted by step, then sigma_rel."""
    if not folder.is_dir():
        raise AnyEMAError(f"{folder} is not a directory")
    pattern = re.compile(re.escape(prefix) + rf"-\d{{9,}}-{STD_TAG}\.safetensors")
    found = {}
    for path in sorted(p for p in folder.iterdir() if pattern.fullmatch(p.name)):
        step, std, buffers = _describe(path)
        if (step, std) in found:
            raise AnyEMAError(f"{path} and {found[step, std][0]} hold the same track")
        found[step, std] = (path, buffers)
    if not found:
        raise AnyEMAError(f"{folder} holds no {prefix}-STEP-STD.safetensors files")
    first_path, first_buffers = next(iter(found.values()))
    for path, buffers in found.values():
        if sorted(buffers) != sorted(first_buffers):
            raise AnyEMAError(f"{path}: buffers differ from {first_path}'s; tracks of different modules")
    return [posthoc.Track(path.name, step, std, functools.partial(_load, path, buffers))
            for (step, std), (path, buffers) in sorted(found.items())]


def synthesize(folder: str | os.PathLike, std: float, step: int | None = None, prefix: str = "ema",
               tensor_stds: Mapping[str, float] | None = None) -> dict[str, torch.Tensor]:
    """The state dict of an EMA with sigma_rel `std` at `step` (default: the newest saved), from saved tracks.

    Uses every track saved up to then (Eq. 129 with the weights of Algorithm 3); floating tensors are float32.
    tensor_stds gives named parameters their own sigma_rel (paper Figure 5b;
    edm2.procedures.posthoc.combine_per_tensor), the others keep `std`.
    """
    tensor_stds = dict(tensor_stds or {})
    phema.std_to_exp(np.float64([std, *tensor_stds.values()]))  # an impossible sigma_rel: refused before any read
    tracks = _tracks(Path(folder), prefix)
    out_step = tracks[-1].nimg if step is None else step
    if out_step not in {t.nimg for t in tracks}:
        raise AnyEMAError(f"no track saved at step {step}; saved steps: {sorted({t.nimg for t in tracks})}")
    used = [t for t in tracks if t.nimg <= out_step]
    if tensor_stds:
        _check_names(Path(folder) / used[-1].name, tensor_stds)
        net, _ = posthoc.combine_per_tensor(used, out_step, std, tensor_stds)
    else:
        outputs = posthoc.combine(used, out_step, [std], batch=1)
        _, net, _ = next(outputs)
        outputs.close()
    return {name: t.detach().clone() for name, t in net.state_dict().items()}


def _check_names(path: Path, tensor_stds: Mapping[str, float]) -> None:
    """Refuse a per-tensor length for a tensor the tracks do not average (read from the file's header)."""
    _, _, buffers = _describe(path)
    with safetensors.safe_open(str(path), framework="pt") as f:
        averaged = dict.fromkeys(name for name in f.keys() if name not in buffers)
    try:
        posthoc.check_tensor_names(tensor_stds, averaged)
    except posthoc.PosthocError as e:
        raise AnyEMAError(f"{path}: {e}") from None
