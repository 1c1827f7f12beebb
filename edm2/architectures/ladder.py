"""The paper's configurations before G (Table 1): ADM-style U-Nets of CONFIG C (Figure 18, architectural
streamlining), D (Figure 19, magnitude-preserving learned layers) and E (Figure 20, forced weight normalization).

The three share one architecture and differ in their learned layers:
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

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from edm2 import families, network_args
from edm2.layers import ArchitectureError, MPConv, MPFourier, cosine_attention, resample

CONFIGS = ("C", "D", "E")


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the raw weight."""
        w = self.weight.to(x.dtype)
        return x @ w.t() if w.ndim == 2 else F.conv2d(x, w, padding=w.shape[-1] // 2)


class DriftingMPConv(MPConv):
    """CONFIG D's learned layer: Eq. 47 on use (edm2.layers.MPConv), but skipped by the forced weight normalization
    of Eq. 66, so that the raw weight norms grow as Eq. 65 predicts."""

    forced = False


LAYERS = {"C": UniformConv, "D": DriftingMPConv, "E": MPConv}


class LadderBlock(torch.nn.Module):
    """ADM's residual block as streamlined in CONFIG C (Figure 18): norm, SiLU, resample, conv; embedding scale;
    norm, SiLU, dropout, conv; plus the (1x1-projected, resampled) input; then optional cosine self-attention."""

    def __init__(self, in_channels: int, out_channels: int, emb_channels: int, layer: type, resample_mode: str = "keep",
                 attention: bool = False, channels_per_head: int = 64, dropout: float = 0.0):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.resample_mode, self.dropout = resample_mode, dropout
        self.num_heads = out_channels // channels_per_head if attention else 0
        self.conv_res0 = layer(in_channels, out_channels, [3, 3])
        self.emb_linear = layer(emb_channels, out_channels, [])
        self.conv_res1 = layer(out_channels, out_channels, [3, 3])
        self.conv_skip = layer(in_channels, out_channels, [1, 1]) if in_channels != out_channels else None
        self.attn_qkv = layer(out_channels, out_channels * 3, [1, 1]) if self.num_heads else None
        self.attn_proj = layer(out_channels, out_channels, [1, 1]) if self.num_heads else None

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Apply the block to x [N,C,H,W] conditioned on the embedding emb [N,E]."""
        skip = resample(x, self.resample_mode)
        y = resample(F.silu(rms_group_norm(x, num_groups(self.in_channels))), self.resample_mode)
        y = self.conv_res0(y)
        scale = self.emb_linear(emb).unsqueeze(2).unsqueeze(3).to(y.dtype) + 1  # no offset (Appendix B.3)
        y = F.silu(rms_group_norm(y, num_groups(self.out_channels)) * scale)
        if self.training and self.dropout:
            y = F.dropout(y, p=self.dropout)
        x = self.conv_res1(y) + (self.conv_skip(skip) if self.conv_skip is not None else skip)
        if self.num_heads:
            x = x + cosine_attention(x, self.attn_qkv, self.attn_proj, self.num_heads)
        return x


class LadderUNet(torch.nn.Module):
    """The U-Net of CONFIG C, D or E: the G U-Net's levels, blocks and names over LadderBlock."""

    def __init__(self, img_resolution: int, img_channels: int, label_dim: int, config: str = "E",
                 model_channels: int = 192, channel_mult: Sequence[int] = (1, 2, 3, 4),
                 channel_mult_noise: int | None = None, channel_mult_emb: int | None = None, num_blocks: int = 3,
                 attn_resolutions: Sequence[int] = (16, 8), channels_per_head: int = 64, dropout: float = 0.0):
        if config not in LAYERS:
            raise ArchitectureError(f"unknown network configuration {network_args.shown(config)}; choose one of "
                                    f"{', '.join(CONFIGS)}")
        network_args.check_unet(dict(locals(), label_balance=0.5, concat_balance=0.5), dict(
            channels_per_head=channels_per_head, dropout=dropout, res_balance=0.5, attn_balance=0.5, clip_act=None))
        super().__init__()
        layer = LAYERS[config]
        cblock = [model_channels * m for m in channel_mult]
        cnoise = model_channels * channel_mult_noise if channel_mult_noise is not None else cblock[0]
        cemb = model_channels * channel_mult_emb if channel_mult_emb is not None else max(cblock)
        self.label_dim = label_dim
        self.emb_fourier = MPFourier(cnoise)
        self.emb_noise = layer(cnoise, cemb, [])
        self.emb_layer1 = layer(cemb, cemb, [])
        self.emb_label = layer(label_dim, cemb, []) if label_dim else None
        kw = dict(layer=layer, channels_per_head=channels_per_head, dropout=dropout)

        self.enc = torch.nn.ModuleDict()
        cout = img_channels + 1  # the constant-1 channel
        for level, channels in enumerate(cblock):
            res = img_resolution >> level
            if level == 0:
                cin, cout = cout, channels
                self.enc[f"{res}x{res}_conv"] = layer(cin, cout, [3, 3])
            else:
                self.enc[f"{res}x{res}_down"] = LadderBlock(cout, cout, cemb, resample_mode="down", **kw)
            for idx in range(num_blocks):
                cin, cout = cout, channels
                self.enc[f"{res}x{res}_block{idx}"] = LadderBlock(cin, cout, cemb, attention=res in attn_resolutions,
                                                                  **kw)
        self.dec = torch.nn.ModuleDict()
        skips = [block.out_channels for block in self.enc.values()]
        for level, channels in reversed(list(enumerate(cblock))):
            res = img_resolution >> level
            if level == len(cblock) - 1:
                self.dec[f"{res}x{res}_in0"] = LadderBlock(cout, cout, cemb, attention=True, **kw)
                self.dec[f"{res}x{res}_in1"] = LadderBlock(cout, cout, cemb, **kw)
            else:
                self.dec[f"{res}x{res}_up"] = LadderBlock(cout, cout, cemb, resample_mode="up", **kw)
            for idx in range(num_blocks + 1):
                cin, cout = cout + skips.pop(), channels
                self.dec[f"{res}x{res}_block{idx}"] = LadderBlock(cin, cout, cemb, attention=res in attn_resolutions,
                                                                  **kw)
        self.out_conv = layer(cout, img_channels, [3, 3])

    def forward(self, x: torch.Tensor, noise_labels: torch.Tensor, class_labels: torch.Tensor | None) -> torch.Tensor:
        """Evaluate F(x; c_noise, labels)."""
        # Eq. 35 is cos(2 pi (f a + phi)); MPFourier's sqrt(2) (Eq. 75) comes only in G.
        emb = self.emb_noise(self.emb_fourier(noise_labels) / math.sqrt(2))
        emb = self.emb_layer1(F.silu(emb))
        if self.emb_label is not None:
            emb = emb + self.emb_label(class_labels * math.sqrt(class_labels.shape[1]))
        emb = F.silu(emb)
        x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        skips = []
        for name, block in self.enc.items():
            x = block(x) if name.endswith("_conv") else block(x, emb)
            skips.append(x)
        for name, block in self.dec.items():
            if "block" in name:
                x = torch.cat([x, skips.pop()], dim=1)
            x = block(x, emb)
        return self.out_conv(F.silu(rms_group_norm(x, num_groups(x.shape[1]))))


def ladder_blocks(unet: LadderUNet) -> list[tuple[str, torch.nn.Module]]:
    """The encoder and decoder blocks, named 'enc.16x16_block0' etc. as the G U-Net's, in evaluation order."""
    return [(f"{side}.{name}", block) for side, blocks in (("enc", unet.enc), ("dec", unet.dec))
            for name, block in blocks.items() if isinstance(block, LadderBlock)]


def _constructor(config: str):
    def construct(img_resolution: int, img_channels: int, label_dim: int, **arguments) -> LadderUNet:
        return LadderUNet(img_resolution, img_channels, label_dim, config=config, **arguments)
    construct.__doc__ = f"The U-Net of CONFIG {config}."
    return construct


SUMMARIES = {"C": "the paper's CONFIG C: ADM streamlined (no biases, Eq. 29 group norm, cosine attention)",
             "D": "the paper's CONFIG D: C with magnitude-preserving learned layers (Eq. 47), weights free to grow",
             "E": "the paper's CONFIG E: D with forced weight normalization (Eq. 66); Eq. 67 decay in its presets"}
# The families 'config-c', 'config-d' and 'config-e' (G is the release's 'edm2').
FAMILIES = {config: families.register(families.NetworkFamily(
    name=f"config-{config.lower()}", constructor=_constructor(config), blocks=ladder_blocks,
    options=("channel_mult", "num_blocks", "attn_resolutions"), summary=SUMMARIES[config])) for config in CONFIGS}
