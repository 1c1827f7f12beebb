"""The per-tensor EMA-length sweep (paper Figure 5b): one weight tensor's EMA length varied at a time, every other
tensor kept at a global length, the network measured at each; no retraining, only post-hoc reconstruction.

One pass of edm2.procedures.posthoc.combine builds the network at the global length and at every swept length (batched
as `batch` outputs per pass); the global network's parameters and the chosen tensors at each swept length are kept, so
memory is two networks plus the chosen tensors at every swept length. A tensor at a swept length is the whole-network
reconstruction's tensor at that length (solved together with the other lengths: the coefficients differ from a lone
solve by float64 round-off, see combine_per_tensor). As in edm2.eval.sweep, every network is rounded to float16 as a
reconstruction file stores it. The whole-network sweep at the same lengths is measured too, the thick curve of Figure
5b.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from edm2.eval.magnitudes import bucket
from edm2.eval.sweep import round_to_stored
from edm2.procedures import posthoc

TENSOR_SWEEP_JSON, TENSOR_SWEEP_PNG = "ema-tensor-sweep.json", "ema-tensor-sweep.png"
CHOICES = ("all", "buckets")  # every weight tensor of the U-Net, or the first named of each resolution bucket


def weight_tensors(names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[str]:
    """The U-Net's weight tensors among named parameters (matrices and kernels; biases, gains and the log-variance
    head's layer are left out, as in the paper's Appendix D.6)."""
    return [name for name, shape in zip(names, shapes) if name.startswith("unet.") and len(shape) >= 2]


def choose_tensors(choice: str | Sequence[str], names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[str]:
    """'all' weight tensors, the first in names of each resolution bucket ('buckets'), or the named ones, each
    checked to be one of the weight tensors."""
    weights = weight_tensors(names, shapes)
    if choice == "all":
        return weights
    if choice == "buckets":
        first: dict[str, str] = {}
        for name in weights:
            first.setdefault(bucket(name.removeprefix("unet.")), name)
        return list(first.values())
    posthoc.check_tensor_names(choice, dict.fromkeys(weights))
    return list(dict.fromkeys(choice))


def tensor_sweep(tracks: Sequence[posthoc.Track], out_nimg: int, std: float, stds: Sequence[float],
                 tensors: Sequence[str], measure: Callable[[torch.nn.Module], dict[str, float]], batch: int = 8,
                 report: Callable[[str], None] = print) -> list[dict]:
    """Rows {tensor, std, metrics...}: tensor None for the whole network at each length (the global sweep), else
    that tensor at std and every other at the global length `std`."""
    std = float(std)
    lengths = list(dict.fromkeys([std, *map(float, stds)]))
    kept: dict[float, dict[str, torch.Tensor]] = {}
    base, rows = None, []
    outputs = posthoc.combine(tracks, out_nimg, lengths, batch)
    with contextlib.closing(outputs):
        for length, net, metadata in outputs:
            params = dict(round_to_stored(net).named_parameters())
            posthoc.check_tensor_names(tensors, params)
            kept[length] = {name: params[name].detach().clone() for name in tensors}
            if length == std:
                base = {name: p.detach().clone() for name, p in params.items()}
            rows.append(dict(tensor=None, std=length, **measure(net), profile_error=metadata["phema"]["profile_error"]))
            report(f"whole network at sigma_rel {length:.3f}: {_values(rows[-1])}")
    baseline = next(row for row in rows if row["std"] == std)
    for name in tensors:
        for length in map(float, stds):
            if length == std:
                rows.append(dict(baseline, tensor=name))
                continue
            _assign(net, base, {name: kept[length][name]})
            rows.append(dict(tensor=name, std=length, **measure(net)))
            report(f"{name} at sigma_rel {length:.3f}: {_values(rows[-1])}")
    return rows


def _assign(net: torch.nn.Module, base: dict[str, torch.Tensor], moved: dict[str, torch.Tensor]) -> None:
    """Set net's parameters to base, those in moved to theirs."""
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(moved.get(name, base[name]))


def _values(row: dict) -> str:
    return "  ".join(f"{k} {v:.4f}" for k, v in row.items() if k not in ("tensor", "std", "profile_error"))
