"""Magnitude-preserving primitives of the EDM2 network (paper Appendix B.7, Figure 21)."""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from edm2.errors import EDM2Error


class ArchitectureError(EDM2Error):
    """A network or layer asked for with settings it does not have (an unknown block flavor or resampling)."""


def normalize(x: torch.Tensor, dim: Sequence[int] | int | None = None, eps: float = 1e-4) -> torch.Tensor:
    """Scale x to unit RMS along `dim` (default: all but the first), Algorithm 1."""
    if dim is None:
        dim = list(range(1, x.ndim))
    norm_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=norm_dtype)
    # eps is added to the RMS (Algorithm 1), not inside the square root of Eq. 30.
    norm = torch.add(eps, norm, alpha=math.sqrt(norm.numel() / x.numel()))
    return x / norm.to(x.dtype)


def mp_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU rescaled to unit output magnitude for unit-normal input (Eq. 81)."""
    return F.silu(x) / 0.596


def mp_sum(a: torch.Tensor, b: torch.Tensor, t: float = 0.5) -> torch.Tensor:
    """Weighted sum of a and b that keeps unit magnitude (Eq. 88)."""
    return a.lerp(b, t) / math.sqrt((1 - t) ** 2 + t**2)


def mp_cat(a: torch.Tensor, b: torch.Tensor, dim: int = 1, t: float = 0.5) -> torch.Tensor:
    """Concatenation with per-part weights that keep unit magnitude (Eq. 103)."""
    na, nb = a.shape[dim], b.shape[dim]
    c = math.sqrt((na + nb) / ((1 - t) ** 2 + t**2))
    wa = c / math.sqrt(na) * (1 - t)
    wb = c / math.sqrt(nb) * t
    return torch.cat([wa * a, wb * b], dim=dim)


def resample(x: torch.Tensor, mode: str = "keep") -> torch.Tensor:
    """Box-filter (filter [1,1]) downsampling or nearest upsampling by 2; 'keep' returns x."""
    if mode == "keep":
        return x
    if mode == "down":
        # The [1,1] box filter with stride 2 is exactly a 2x2 average.
        return F.avg_pool2d(x, 2)
    if mode == "up":
        # Transposed convolution with the [1,1] filter (gain 4) repeats every pixel 2x2.
        return x.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)
    raise ArchitectureError(f"unknown resample mode {mode!r}")


class MPFourier(torch.nn.Module):
    """Random Fourier features cos(2 pi (f x + p)) * sqrt(2) of unit magnitude (Eq. 75)."""

    def __init__(self, num_channels: int, bandwidth: float = 1.0):
        super().__init__()
        self.register_buffer("freqs", 2 * np.pi * torch.randn(num_channels) * bandwidth)
        self.register_buffer("phases", 2 * np.pi * torch.rand(num_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embed a 1-D tensor of scalars as [len(x), num_channels] features (float32, or float64 after .double())."""
        base = torch.promote_types(self.freqs.dtype, torch.float32)
        y = x.to(base).outer(self.freqs.to(base)) + self.phases.to(base)
        return (y.cos() * math.sqrt(2)).to(x.dtype)


_recomputing = threading.local()  # set while activation checkpointing replays a forward pass


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Mark a replayed forward pass (torch.utils.checkpoint's recomputation): MPConv skips its forced weight
    normalization there, so the replay computes what the first pass did and leaves the weights alone."""
    previous = getattr(_recomputing, "active", False)
    _recomputing.active = True
    try:
        yield
    finally:
        _recomputing.active = previous


class MPConv(torch.nn.Module):
    """Convolution (kernel [k,k]) or linear layer (kernel []) with forced weight normalization.

    In evaluation mode, when no gradient is wanted, the normalized, gain-scaled weight is a constant of the
    weights: it is computed once and reused until the weight or gain changes in place (their version
    counters), moves (.to, .half, ...), is loaded (load_state_dict), or the layer is set to training mode.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel: Sequence[int]):
        super().__init__()
        self.out_channels = out_channels
        self.weight = torch.nn.Parameter(torch.randn(out_channels, in_channels, *kernel))
        self._cached: tuple[tuple, torch.Tensor] | None = None  # (key, weight) of the evaluation-mode weight

    def forward(self, x: torch.Tensor, gain: float | torch.Tensor = 1) -> torch.Tensor:
        """Apply the layer with unit-norm weight rows scaled by gain / sqrt(fan_in)."""
        if self._cacheable(gain):
            w = self._cached_weight(x.dtype, gain)
        else:
            w = self.effective_weight(x.dtype, gain)
        if w.ndim == 2:
            return x @ w.t()
        return F.conv2d(x, w, padding=w.shape[-1] // 2)

    def effective_weight(self, dtype: torch.dtype, gain: float | torch.Tensor = 1) -> torch.Tensor:
        """The weight the layer applies, in dtype; in training mode first forces the stored rows to norm
        sqrt(fan_in). Normalized in float32 (float64 for a float64 weight, a reference computation)."""
        w = self._normalization_weight()
        # A replayed pass finds the weights normalized already; a compiled graph cannot write them (inductor drops
        # the write), so compiled training applies Eq. 66 before the graph (force_weight_normalization).
        if self.training and not getattr(_recomputing, "active", False) and not torch.compiler.is_compiling():
            self._force_normalization(w)
        # Standard weight normalization on use (Eq. 47) makes the gradient tangent (Eq. 59).
        w = normalize(w)
        w = w * (gain / math.sqrt(w[0].numel()))
        return w.to(dtype)

    def _normalization_weight(self) -> torch.Tensor:
        """The raw weight in the dtype it is normalized in: float32, or float64 for a float64 weight."""
        return self.weight.to(torch.promote_types(self.weight.dtype, torch.float32))

    def _force_normalization(self, w: torch.Tensor) -> None:
        """Forced weight normalization (Eq. 66): rows of the raw weight keep norm sqrt(fan_in); w is
        _normalization_weight()."""
        with torch.no_grad():
            self.weight.copy_(normalize(w))

    def _cacheable(self, gain: float | torch.Tensor) -> bool:
        """Whether the applied weight may be reused: evaluation mode, eager, with no gradient to record (a cached
        weight cannot be part of more than one autograd graph), on tensors that count their in-place writes."""
        tensors = [self.weight, *([gain] if isinstance(gain, torch.Tensor) else [])]
        if self.training or torch.compiler.is_compiling() or any(t.is_inference() for t in tensors):
            return False
        return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))

    def _cached_weight(self, dtype: torch.dtype, gain: float | torch.Tensor) -> torch.Tensor:
        """effective_weight, recomputed only when its inputs changed since the last call."""
        key = (dtype, torch.is_inference_mode_enabled(), _tensor_key(self.weight),
               _tensor_key(gain) if isinstance(gain, torch.Tensor) else float(gain))
        if self._cached is None or self._cached[0] != key:
            self._cached = None  # free the stale weight before computing the new one
            self._cached = (key, self.effective_weight(dtype, gain))
        return self._cached[1]

    def train(self, mode: bool = True) -> MPConv:
        """Set training mode (see torch.nn.Module.train); entering it frees the cached evaluation-mode weight."""
        if mode:
            self._cached = None
        return super().train(mode)

    def _apply(self, fn, recurse: bool = True):
        # .to(), .half(), .cuda(), memory formats: the cached weight would keep the old device or dtype.
        self._cached = None
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._cached = None
        super()._load_from_state_dict(*args, **kwargs)


def force_weight_normalization(module: torch.nn.Module) -> None:
    """Eq. 66 for every MPConv of module in training mode, with the operations its forward uses: for compiled
    training, whose graph leaves the weights alone (see MPConv.effective_weight)."""
    for layer in module.modules():
        if isinstance(layer, MPConv) and layer.training:
            layer._force_normalization(layer._normalization_weight())


def _tensor_key(t: torch.Tensor) -> tuple:
    """What identifies a tensor's current values: in-place writes bump its version counter; replacing its
    storage (moving it, assigning .data) changes the data pointer, device or dtype."""
    return id(t), t._version, t.data_ptr(), t.device, t.dtype, t.shape, t.stride()
