"""Magnitude-preserving primitives of the EDM2 network (paper Appendix B.7, Figure 21)."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import handle_torch_function, has_torch_function

from edm2.errors import EDM2Error


class ArchitectureError(EDM2Error):
    """A network or layer asked for with settings it does not have (an unknown block flavor or resampling)."""


def normalize(x: torch.Tensor, dim: Sequence[int] | int | None = None, eps: float = 1e-4) -> torch.Tensor:
    """Scale x to unit RMS along `dim` (default: all but the first), Algorithm 1."""
    # Each primitive here takes part in torch function dispatch, so that edm2.eval.flops prices it whole.
    if has_torch_function((x,)):
        return handle_torch_function(normalize, (x,), x, dim=dim, eps=eps)
    if dim is None:
        dim = list(range(1, x.ndim))
    norm_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=norm_dtype)
    # eps is added to the RMS (Algorithm 1), not inside the square root of Eq. 30.
    norm = torch.add(eps, norm, alpha=math.sqrt(norm.numel() / x.numel()))
    return x / norm.to(x.dtype)


def mp_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU rescaled to unit output magnitude for unit-normal input (Eq. 81)."""
    if has_torch_function((x,)):
        return handle_torch_function(mp_silu, (x,), x)
    return F.silu(x) / 0.596


def mp_sum(a: torch.Tensor, b: torch.Tensor, t: float = 0.5) -> torch.Tensor:
    """Weighted sum of a and b that keeps unit magnitude (Eq. 88)."""
    if has_torch_function((a, b)):
        return handle_torch_function(mp_sum, (a, b), a, b, t=t)
    return a.lerp(b, t) / math.sqrt((1 - t) ** 2 + t**2)


def mp_cat(a: torch.Tensor, b: torch.Tensor, dim: int = 1, t: float = 0.5) -> torch.Tensor:
    """Concatenation with per-part weights that keep unit magnitude (Eq. 103)."""
    if has_torch_function((a, b)):
        return handle_torch_function(mp_cat, (a, b), a, b, dim=dim, t=t)
    na, nb = a.shape[dim], b.shape[dim]
    c = math.sqrt((na + nb) / ((1 - t) ** 2 + t**2))
    wa = c / math.sqrt(na) * (1 - t)
    wb = c / math.sqrt(nb) * t
    return torch.cat([wa * a, wb * b], dim=dim)


def resample(x: torch.Tensor, mode: str = "keep") -> torch.Tensor:
    """Box-filter (filter [1,1]) downsampling or nearest upsampling by 2; 'keep' returns x."""
    if has_torch_function((x,)):
        return handle_torch_function(resample, (x,), x, mode=mode)
    if mode == "keep":
        return x
    if mode == "down":
        # The [1,1] box filter with stride 2 is exactly a 2x2 average.
        return F.avg_pool2d(x, 2)
    if mode == "up":
        # Transposed convolution with the [1,1] filter (gain 4) repeats every pixel 2x2: nearest upsampling, which
        # keeps a channels-last input channels-last (repeat_interleave returned NCHW, and every later elementwise
        # op of the decoder then mixed the two layouts).
        return F.interpolate(x, scale_factor=2, mode="nearest")
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


class FourierFeatures(MPFourier):
    """Eq. 35's Fourier features cos(2 pi (f a + phi)) of CONFIG C to F: MPFourier without G's sqrt(2) (Eq. 75)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The features of a 1-D tensor of scalars."""
        return super().forward(x) / math.sqrt(2)


class MPConv(torch.nn.Module):
    """Convolution (kernel [k,k]) or linear layer (kernel []) whose weight rows are normalized on use (Eq. 47).

    The layer never writes its weight. When the stored weight is renormalized and when a normalized weight is
    reused are decided by the two steps below it: force_weight_normalization (Eq. 66), which the training step
    applies to every layer before each forward pass, and weights_normalized_once, within which sampling and
    evaluation use each layer's weight normalized once.
    """

    forced = True  # renormalized by force_weight_normalization (Eq. 66); config D's layers are not

    def __init__(self, in_channels: int, out_channels: int, kernel: Sequence[int]):
        super().__init__()
        self.out_channels = out_channels
        self.weight = torch.nn.Parameter(torch.randn(out_channels, in_channels, *kernel))
        self.normalized_once: torch.Tensor | None = None  # set within weights_normalized_once() only

    def forward(self, x: torch.Tensor, gain: float | torch.Tensor = 1, interleave: int = 1) -> torch.Tensor:
        """Apply the layer with unit-norm weight rows scaled by gain / sqrt(fan_in); with interleave, its output
        channels regrouped (deinterleaved)."""
        w = normalized_weight(self.weight) if self.normalized_once is None else self.normalized_once
        w = deinterleaved((w * (gain / math.sqrt(w[0].numel()))).to(x.dtype), interleave)
        return conv_or_linear(x, w)


def conv_or_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x through weight w as a layer applies it, without bias: a linear map for a 2-D weight [out, in], else a
    convolution padded to keep the resolution."""
    if w.ndim == 2:
        return x @ w.t()
    return F.conv2d(x, w, padding=w.shape[-1] // 2)


def normalized_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight with every output row scaled to norm sqrt(fan_in) (normalize), computed in float32 (float64 for a
    float64 weight, a reference computation)."""
    return normalize(weight.to(torch.promote_types(weight.dtype, torch.float32)))


def self_attention(x: torch.Tensor, qkv: torch.nn.Module, proj: torch.nn.Module, num_heads: int,
                   cosine: bool) -> torch.Tensor:
    """Multi-head self-attention of x [N,C,H,W] through the layers qkv (C -> 3C) and proj (C -> C): with cosine,
    of pixel-normalized q, k, v (Eq. 30-34, CONFIG C on); without, ADM's plain scaled-dot-product attention."""
    n, c, h, w = x.shape
    # The release lays qkv's output channels out as [head, channel, (q,k,v)]; the layer computes them regrouped as
    # [(q,k,v), head, channel] (its weight rows reordered, each channel's value unchanged). In a channels-last
    # activation each head's channels are then adjacent: the norms and the products below read them in order, where
    # the interleaved layout made torch.compile's CPU code reduce 32 channels per OpenMP region (a third of a toy
    # step).
    parts = qkv(x, interleave=3).reshape(n, 3, num_heads, -1, h * w)
    q, k, v = (normalize(parts, dim=3) if cosine else parts).unbind(1)
    return proj(attention(q, k, v).reshape(n, c, h, w))


TEXT_ATTENTION_KINDS = ("cross", "fused")


def text_attention(x: torch.Tensor, text: torch.Tensor, mask: torch.Tensor, q_layer: torch.nn.Module,
                   kv_layer: torch.nn.Module, proj: torch.nn.Module, num_heads: int, kind: str) -> torch.Tensor:
    """Cosine multi-head attention of the image x [N,C,H,W] over text rows text [N,T,D] (mask [N,T] bool: False rows
    take no part): 'cross' takes queries from the image (q_layer: C -> C) and keys and values from the text
    (kv_layer: D -> 2C); 'fused' (NeMo's) takes queries, keys and values from the image (q_layer: C -> 3C) with the
    text's keys and values appended. q, k, v are pixel-normalized per head as in the release's self-attention
    (Eq. 30-34); the result, through proj (C -> C), has x's shape."""
    n, c, h, w = x.shape
    if kind not in TEXT_ATTENTION_KINDS:
        raise ArchitectureError(f"unknown text attention kind {kind!r}: expected {' or '.join(TEXT_ATTENTION_KINDS)}")
    # Padding rows are zeroed before the projection as well as masked: their values can never reach the output.
    text = normalize(text, dim=2) * mask.unsqueeze(2).to(text.dtype)
    kv = kv_layer(text.to(x.dtype)).reshape(n, -1, 2, num_heads, c // num_heads)
    k_text, v_text = normalize(kv, dim=4).permute(2, 0, 3, 4, 1).unbind(0)  # each [N, heads, channels, T]
    if kind == "cross":
        q = normalize(q_layer(x).reshape(n, num_heads, -1, h * w), dim=2)
        k, v, keep = k_text, v_text, mask
    else:
        q, k, v = normalize(q_layer(x).reshape(n, 3, num_heads, -1, h * w), dim=3).unbind(1)
        k, v = torch.cat([k, k_text], dim=3), torch.cat([v, v_text], dim=3)
        keep = torch.cat([torch.ones([n, h * w], dtype=torch.bool, device=mask.device), mask], dim=1)
    return proj(attention(q, k, v, mask=keep).reshape(n, c, h, w))


# The devices whose fused scaled-dot-product attention kernels run it (CUDA's also spare the score matrices' memory);
# elsewhere the release's two products around a softmax run (see attention).
FUSED_ATTENTION_DEVICES = ("cuda",)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q^T k / sqrt(N_c)) v per head (Eq. 10-11) of q, k, v [N, heads, channels, tokens], in that layout;
    with mask [N, key tokens] (bool), the keys where it is False take no part (weight exactly 0).

    On the CPU as the release writes it, two batched products around a softmax: the CPU's fused kernel is slower on
    these small heads (its backward 3x on a Xeon with AMX, bfloat16, 256 tokens of 16 channels), and the products
    read channels-last q, k, v as they lie. On CUDA by scaled-dot-product attention. Forward-mode AD
    (torch.func.jvp, as consistency-model training takes it) works on both: the products have forward-mode rules,
    and under tangents SDPA runs its math kernel, as the fused ones have none.
    """
    if has_torch_function((q, k, v)):
        return handle_torch_function(attention, (q, k, v), q, k, v, mask=mask)
    keep = None if mask is None else mask[:, None, None, :]  # [N, 1, 1, key tokens]: every head and query
    if q.device.type not in FUSED_ATTENTION_DEVICES:
        logits = torch.einsum("nhcq,nhck->nhqk", q, k / math.sqrt(q.shape[2]))
        if keep is not None:
            logits = logits.masked_fill(~keep, -math.inf)
        return torch.einsum("nhqk,nhck->nhcq", logits.softmax(dim=3), v)
    tangents = any(forward_ad.unpack_dual(t).tangent is not None for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH) if tangents else contextlib.nullcontext():
        # SDPA takes tokens as rows; its boolean mask is True where a key takes part.
        return F.scaled_dot_product_attention(*(t.transpose(2, 3) for t in (q, k, v)),
                                              attn_mask=keep).transpose(2, 3)


def deinterleaved(rows: torch.Tensor, interleave: int) -> torch.Tensor:
    """rows (along dim 0) stored interleaved in groups of `interleave` (row j * interleave + i), regrouped so that
    row i * (len / interleave) + j holds it; interleave 1 returns rows as they are."""
    if interleave == 1:
        return rows
    return rows.unflatten(0, (-1, interleave)).transpose(0, 1).flatten(0, 1)


def mpconvs(*nets: object) -> list[MPConv]:
    """The MPConv layers of those nets that are modules (a plain function or None has none), each once."""
    modules = (m for net in nets if isinstance(net, torch.nn.Module) for m in net.modules())
    return list(dict.fromkeys(m for m in modules if isinstance(m, MPConv)))


def force_weight_normalization(net: torch.nn.Module) -> None:
    """Forced weight normalization (Eq. 66): every MPConv's stored rows back to norm sqrt(fan_in). The training
    step applies it before each forward pass, eager or compiled, so that no forward pass writes weights."""
    with torch.no_grad():
        for layer in (layer for layer in mpconvs(net) if layer.forced):
            layer.weight.copy_(normalized_weight(layer.weight))


@contextlib.contextmanager
def weights_normalized_once(*nets: object) -> Iterator[None]:
    """Within: no gradients, and every MPConv of the nets applies its weight as normalized on entry, bit for bit
    what it would compute on each call; on exit the normalized weights are dropped.

    For sampling and evaluation, which apply fixed weights many times: a weight changed within is not seen before
    the next entry. A nested entry leaves the layers an outer one prepared as they are.
    """
    layers = [layer for layer in mpconvs(*nets) if layer.normalized_once is None]
    with torch.no_grad():
        try:
            for layer in layers:
                layer.normalized_once = normalized_weight(layer.weight)
            yield
        finally:
            for layer in layers:
                layer.normalized_once = None
