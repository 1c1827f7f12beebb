"""The paper's configurations B to E (Table 1): the ADM U-Nets of CONFIG B (Figure 17, the EDM baseline tuned), C
(Figure 18, architectural streamlining), D (Figure 19, magnitude-preserving learned layers) and E (Figure 20, forced
weight normalization). F is edm2.architectures.config_f.

CONFIG B is ADM as the EDM baseline has it (Appendix B.1-B.2; NVlabs/edm's DhariwalUNet), with attention at 16x16
and 8x8 only: learned layers with biases, weight and bias from U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the last layer of
each residual branch, the attention projection and the output layer zero-initialized; group normalization with mean
subtraction and a learned per-channel scale and bias (eps 1e-5); the embedding scaling and shifting each channel
between the convolutions; scaled-dot-product attention after a group norm; sinusoidal timestep features of c_noise
(max period 10000) through two linear layers; class embeddings drawn from N(0, 1) for unscaled one-hot labels; no
constant input channel.

C, D and E share one architecture and differ in their learned layers:
- C: plain convolutions and linear layers without biases, initialized as ADM does every layer (He's uniform init,
  bound 1/sqrt(fan_in), PyTorch's default); the raw weights are applied as they are.
- D: every learned layer normalizes its weight rows on use (Eq. 47, edm2.layers.MPConv) from N(0,1) init, but
  the stored weights are never renormalized: their norms drift (Eq. 59-65).
- E: D's layers, with forced weight normalization (Eq. 66) in the training step; its learning-rate decay (Eq. 67)
  is the preset's.
Common to all three (Appendix B.3): a constant-1 input channel; group normalization without mean subtraction or
learned scale (Eq. 29, 32 groups of at least 4 channels as ADM); the embedding's dynamic offset removed (scale
only); cosine attention (Eq. 30-34) at the attention resolutions and in the lowest decoder level's first block;
Fourier features of c_noise (Eq. 35-36) through ADM's two-layer embedding network; one-hot labels scaled by
sqrt(N); plain sums for residuals and concatenation for the U-Net skips (the magnitude-preserving ones are G's).
State-dict names follow the G U-Net's (enc.16x16_block0.conv_res0.weight, ...), so the magnitude probe's buckets
and the per-tensor EMA sweep read every configuration alike.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from edm2 import families, network_args
from edm2.layers import (ArchitectureError, FourierFeatures, MPConv, conv_or_linear, deinterleaved, resample,
                         self_attention)
from edm2.network_args import UNetHyperparameters, unet_layout

CONFIGS = ("B", "C", "D", "E")


class RMSGroupNorm(torch.nn.Module):
    """Eq. 29 as a layer (no parameters): what CONFIG C made of ADM's group norm."""

    def __init__(self, channels: int):
        super().__init__()
        self.num_groups = num_groups(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """rms_group_norm of x."""
        return rms_group_norm(x, self.num_groups)


class AffineGroupNorm(torch.nn.GroupNorm):
    """CONFIG B's group norm, ADM's: zero mean and unit variance per group, then a learned per-channel scale and bias
    (initialized to 1 and 0), eps 1e-5; computed in the input's dtype."""

    def __init__(self, channels: int):
        super().__init__(num_groups(channels), channels, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize x [N,C,H,W]."""
        return F.group_norm(x, self.num_groups, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


def rms_group_norm(x: torch.Tensor, num_groups: int, eps: float = 1e-4) -> torch.Tensor:
    """Eq. 29: each group of channels divided by its RMS over pixels and channels; no mean, no scale."""
    groups = x.reshape(x.shape[0], num_groups, -1)
    rms = (groups.to(torch.float32).square().mean(dim=2, keepdim=True) + eps).sqrt()
    return (groups / rms.to(x.dtype)).reshape(x.shape)


def num_groups(channels: int) -> int:
    """ADM's group count: 32, fewer where a group would hold under 4 channels."""
    return max(1, min(32, channels // 4))


class UniformConv(torch.nn.Module):
    """CONFIG C's learned layer: convolution (kernel [k,k]) or linear layer (kernel []) without bias, its weight
    drawn from U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (He's uniform init as ADM applies it) and applied as stored."""

    def __init__(self, in_channels: int, out_channels: int, kernel: Sequence[int]):
        super().__init__()
        self.out_channels = out_channels
        fan_in = in_channels * math.prod(kernel)
        self.weight = torch.nn.Parameter((torch.rand(out_channels, in_channels, *kernel) * 2 - 1) / math.sqrt(fan_in))

    def forward(self, x: torch.Tensor, interleave: int = 1) -> torch.Tensor:
        """Apply the raw weight; with interleave, its output channels regrouped (edm2.layers.deinterleaved)."""
        w = deinterleaved(self.weight.to(x.dtype), interleave)
        return conv_or_linear(x, w)


class BiasedLayer(torch.nn.Module):
    """CONFIG B's learned layer, ADM's: convolution (kernel [k,k]) or linear layer (kernel []) with a bias, weight and
    bias from U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PyTorch's default, as ADM initializes), or both zero (zero=True)."""

    def __init__(self, in_channels: int, out_channels: int, kernel: Sequence[int], zero: bool = False):
        super().__init__()
        self.out_channels = out_channels
        bound = 0 if zero else 1 / math.sqrt(in_channels * math.prod(kernel))
        self.weight = torch.nn.Parameter((torch.rand(out_channels, in_channels, *kernel) * 2 - 1) * bound)
        self.bias = torch.nn.Parameter((torch.rand(out_channels) * 2 - 1) * bound)

    def forward(self, x: torch.Tensor, interleave: int = 1) -> torch.Tensor:
        """Apply weight and bias; with interleave, the output channels regrouped (edm2.layers.deinterleaved)."""
        w, b = (deinterleaved(t.to(x.dtype), interleave) for t in (self.weight, self.bias))
        return F.linear(x, w, b) if w.ndim == 2 else F.conv2d(x, w, b, padding=w.shape[-1] // 2)


class LabelEmbedding(torch.nn.Module):
    """CONFIG B's class embedding: a linear layer without bias whose weight is drawn from N(0, 1), so that a one-hot
    label (unscaled) embeds with unit variance, as ADM's embedding table."""

    def __init__(self, in_channels: int, out_channels: int, kernel: Sequence[int]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_channels, in_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The embedding of one-hot (or soft) labels x [N, label_dim]."""
        return x @ self.weight.to(x.dtype).t()


class TimestepEmbedding(torch.nn.Module):
    """CONFIG B's noise features, ADM's sinusoidal timestep embedding of c_noise: [cos(a f_i), sin(a f_i)] with
    f_i = 10000^(-i / (N/2)), i = 0 .. N/2 - 1 (no parameters)."""

    def __init__(self, num_channels: int):
        super().__init__()
        self.register_buffer("freqs", 10000 ** -(torch.arange(num_channels // 2, dtype=torch.float32) /
                                                 (num_channels // 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embed a 1-D tensor of scalars as [len(x), num_channels] features in x's dtype (float32 at least)."""
        base = torch.promote_types(x.dtype, torch.float32)
        angles = x.to(base).outer(self.freqs.to(base))
        return torch.cat([angles.cos(), angles.sin()], dim=1).to(x.dtype)


class DriftingMPConv(MPConv):
    """CONFIG D's learned layer: Eq. 47 on use (edm2.layers.MPConv), but skipped by the forced weight normalization
    of Eq. 66, so that the raw weight norms grow as Eq. 65 predicts."""

    forced = False


# A learned layer's constructor: (in_channels, out_channels, kernel) -> the layer.
Layer = Callable[[int, int, Sequence[int]], torch.nn.Module]


@dataclasses.dataclass(frozen=True)
class Flavor:
    """What a configuration puts where the ladder's U-Nets differ."""

    layer: Layer  # every learned layer but those below
    last_layer: Layer  # the last layer of each residual branch, the attention projection and the output layer
    label_layer: Layer  # the class embedding
    norm: type  # the group norm
    noise_features: type  # features of c_noise
    label_scale: bool  # one-hot labels times sqrt(label_dim) (C on)
    constant_channel: bool  # a constant-1 input channel (C on)
    shift: bool  # the embedding shifts each channel too (B, ADM's adaptive group norm) or only scales it (C on)
    cosine_attention: bool  # Eq. 30-34 (C on), else a group norm before scaled-dot-product attention (B)


def _streamlined(layer: type) -> Flavor:
    return Flavor(layer=layer, last_layer=layer, label_layer=layer, norm=RMSGroupNorm, noise_features=FourierFeatures,
                  label_scale=True, constant_channel=True, shift=False, cosine_attention=True)


FLAVORS = {
    "B": Flavor(layer=BiasedLayer, last_layer=functools.partial(BiasedLayer, zero=True), label_layer=LabelEmbedding,
                norm=AffineGroupNorm, noise_features=TimestepEmbedding, label_scale=False, constant_channel=False,
                shift=True, cosine_attention=False),
    "C": _streamlined(UniformConv), "D": _streamlined(DriftingMPConv), "E": _streamlined(MPConv)}


class LadderBlock(torch.nn.Module):
    """ADM's residual block (Figure 17), as streamlined from CONFIG C on (Figure 18): norm, SiLU, resample, conv;
    embedding scale (and shift in B); norm, SiLU, dropout, conv; plus the (1x1-projected, resampled) input; then
    optional self-attention (cosine from C on)."""

    def __init__(self, in_channels: int, out_channels: int, emb_channels: int, flavor: Flavor,
                 resample_mode: str = "keep", attention: bool = False, channels_per_head: int = 64,
                 dropout: float = 0.0):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.resample_mode, self.dropout, self.flavor = resample_mode, dropout, flavor
        self.num_heads = out_channels // channels_per_head if attention else 0
        layer = flavor.layer
        self.norm0, self.norm1 = flavor.norm(in_channels), flavor.norm(out_channels)
        self.conv_res0 = layer(in_channels, out_channels, [3, 3])
        self.emb_linear = layer(emb_channels, out_channels * (2 if flavor.shift else 1), [])
        self.conv_res1 = flavor.last_layer(out_channels, out_channels, [3, 3])
        self.conv_skip = layer(in_channels, out_channels, [1, 1]) if in_channels != out_channels else None
        self.attn_norm = flavor.norm(out_channels) if self.num_heads and not flavor.cosine_attention else None
        self.attn_qkv = layer(out_channels, out_channels * 3, [1, 1]) if self.num_heads else None
        self.attn_proj = flavor.last_layer(out_channels, out_channels, [1, 1]) if self.num_heads else None

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Apply the block to x [N,C,H,W] conditioned on the embedding emb [N,E]."""
        skip = resample(x, self.resample_mode)
        y = self.conv_res0(resample(F.silu(self.norm0(x)), self.resample_mode))
        params = self.emb_linear(emb).unsqueeze(2).unsqueeze(3).to(y.dtype)
        if self.flavor.shift:
            scale, shift = params.chunk(2, dim=1)  # ADM's adaptive group norm
            y = F.silu(torch.addcmul(shift, self.norm1(y), scale + 1))
        else:
            y = F.silu(self.norm1(y) * (params + 1))  # no offset (Appendix B.3)
        if self.training and self.dropout:
            y = F.dropout(y, p=self.dropout)
        x = self.conv_res1(y) + (self.conv_skip(skip) if self.conv_skip is not None else skip)
        if self.num_heads:
            cosine = self.flavor.cosine_attention
            y = x if cosine else self.attn_norm(x)  # B normalizes before its attention, as ADM
            x = x + self_attention(y, self.attn_qkv, self.attn_proj, self.num_heads, cosine=cosine)
        return x


class LadderUNet(torch.nn.Module):
    """The U-Net of CONFIG B, C, D or E: the G U-Net's levels, blocks and names over LadderBlock."""

    def __init__(self, img_resolution: int, img_channels: int, label_dim: int, config: str = "E",
                 model_channels: int = 192, channel_mult: Sequence[int] = UNetHyperparameters.channel_mult,
                 channel_mult_noise: int | None = None, channel_mult_emb: int | None = None,
                 num_blocks: int = UNetHyperparameters.num_blocks,
                 attn_resolutions: Sequence[int] = UNetHyperparameters.attn_resolutions,
                 channels_per_head: int = UNetHyperparameters.channels_per_head, dropout: float = 0.0):
        if config not in FLAVORS:
            raise ArchitectureError(f"unknown network configuration {network_args.shown(config)}; choose one of "
                                    f"{', '.join(CONFIGS)}")
        network_args.check_unet(dict(locals(), label_balance=0.5, concat_balance=0.5), dict(
            channels_per_head=channels_per_head, dropout=dropout, res_balance=0.5, attn_balance=0.5, clip_act=None))
        super().__init__()
        flavor = FLAVORS[config]
        layer = flavor.layer
        cblock = [model_channels * m for m in channel_mult]
        cnoise = model_channels * channel_mult_noise if channel_mult_noise is not None else cblock[0]
        cemb = model_channels * channel_mult_emb if channel_mult_emb is not None else max(cblock)
        self.label_dim, self.flavor = label_dim, flavor
        self.emb_fourier = flavor.noise_features(cnoise)
        self.emb_noise = layer(cnoise, cemb, [])
        self.emb_layer1 = layer(cemb, cemb, [])
        self.emb_label = flavor.label_layer(label_dim, cemb, []) if label_dim else None
        kw = dict(flavor=flavor, channels_per_head=channels_per_head, dropout=dropout)

        self.enc, self.dec = torch.nn.ModuleDict(), torch.nn.ModuleDict()
        for slot in unet_layout(img_resolution, img_channels + flavor.constant_channel, cblock, num_blocks,
                                attn_resolutions):
            getattr(self, slot.side)[slot.name] = layer(slot.in_channels, slot.out_channels, [3, 3]) if slot.conv \
                else LadderBlock(slot.in_channels, slot.out_channels, cemb, resample_mode=slot.resample_mode,
                                 attention=slot.attention, **kw)
        cout = cblock[0]  # the decoder ends at the first level's width
        self.out_norm = flavor.norm(cout)
        self.out_conv = flavor.last_layer(cout, img_channels, [3, 3])

    def forward(self, x: torch.Tensor, noise_labels: torch.Tensor, class_labels: torch.Tensor | None) -> torch.Tensor:
        """Evaluate F(x; c_noise, labels)."""
        emb = self.emb_layer1(F.silu(self.emb_noise(self.emb_fourier(noise_labels))))
        if self.emb_label is not None:
            scale = math.sqrt(class_labels.shape[1]) if self.flavor.label_scale else 1
            emb = emb + self.emb_label(class_labels * scale)
        emb = F.silu(emb)
        if self.flavor.constant_channel:
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        skips = []
        for name, block in self.enc.items():
            x = block(x) if name.endswith("_conv") else block(x, emb)
            skips.append(x)
        for name, block in self.dec.items():
            if "block" in name:
                x = torch.cat([x, skips.pop()], dim=1)
            x = block(x, emb)
        return self.out_conv(F.silu(self.out_norm(x)))


def ladder_blocks(unet: LadderUNet) -> list[tuple[str, torch.nn.Module]]:
    """The encoder and decoder blocks, named 'enc.16x16_block0' etc. as the G U-Net's, in evaluation order."""
    return [(f"{side}.{name}", block) for side, blocks in (("enc", unet.enc), ("dec", unet.dec))
            for name, block in blocks.items() if isinstance(block, LadderBlock)]


def _constructor(config: str):
    def construct(img_resolution: int, img_channels: int, label_dim: int, **arguments) -> LadderUNet:
        return LadderUNet(img_resolution, img_channels, label_dim, config=config, **arguments)
    construct.__doc__ = f"The U-Net of CONFIG {config}."
    return construct


SUMMARIES = {"B": "the paper's CONFIG B: the EDM baseline's ADM U-Net without attention at 32x32 (biases, group norm)",
             "C": "the paper's CONFIG C: ADM streamlined (no biases, Eq. 29 group norm, cosine attention)",
             "D": "the paper's CONFIG D: C with magnitude-preserving learned layers (Eq. 47), weights free to grow",
             "E": "the paper's CONFIG E: D with forced weight normalization (Eq. 66); Eq. 67 decay in its presets"}
# The families 'config-b' to 'config-e' (F is config_f's, G the release's 'edm2').
FAMILIES = {config: families.register(families.NetworkFamily(
    name=f"config-{config.lower()}", constructor=_constructor(config), blocks=ladder_blocks,
    hyperparameters=UNetHyperparameters, summary=SUMMARIES[config])) for config in CONFIGS}
