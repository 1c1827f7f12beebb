"""The EDM2 denoiser: magnitude-preserving U-Net (paper Figure 22, config G) and preconditioning."""

from __future__ import annotations

import inspect
import math
from typing import Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.autograd import forward_ad

from edm2 import families, network_args
from edm2.layers import (ArchitectureError, MPConv, MPFourier, mp_cat, mp_silu, mp_sum, normalize, resample,
                         self_attention, text_attention)
from edm2.network_args import TextUNetHyperparameters, UNetHyperparameters, unet_layout
from edm2.text_condition import condition_shape, unpack_condition


class Block(torch.nn.Module):
    """Encoder or decoder block: residual branch, optional cosine self-attention (Figure 21)."""

    # CONFIG G's magnitude-preserving fixed-function layers (Appendix B.7: Eq. 81, Eq. 88); CONFIG F's block
    # (edm2.architectures.config_f) has the plain ones.
    silu = staticmethod(mp_silu)
    add = staticmethod(mp_sum)

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        emb_channels: int,
        flavor: str = "enc",
        resample_mode: str = "keep",
        attention: bool = False,
        channels_per_head: int = UNetHyperparameters.channels_per_head,
        dropout: float = 0.0,
        res_balance: float = 0.3,
        attn_balance: float = 0.3,
        clip_act: float | None = 256,
        modulation: str = network_args.NETWORK_SWITCHES["modulation"],
    ):
        super().__init__()
        if flavor not in ("enc", "dec"):
            raise ArchitectureError(f"unknown block flavor {flavor!r}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.flavor = flavor
        self.resample_mode = resample_mode
        self.num_heads = out_channels // channels_per_head if attention else 0
        self.dropout = dropout
        self.res_balance = res_balance
        self.attn_balance = attn_balance
        self.clip_act = clip_act
        self.modulation = modulation
        # Registration order fixes the state-dict order of the release's checkpoints.
        self.emb_gain = torch.nn.Parameter(torch.zeros([]))
        self.conv_res0 = MPConv(out_channels if flavor == "enc" else in_channels, out_channels, [3, 3])
        self.emb_linear = MPConv(emb_channels, out_channels, [])
        self.conv_res1 = MPConv(out_channels, out_channels, [3, 3])
        self.conv_skip = MPConv(in_channels, out_channels, [1, 1]) if in_channels != out_channels else None
        self.attn_qkv = MPConv(out_channels, out_channels * 3, [1, 1]) if self.num_heads else None
        self.attn_proj = MPConv(out_channels, out_channels, [1, 1]) if self.num_heads else None

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Apply the block to x [N,C,H,W] conditioned on the embedding emb [N,E]."""
        x = resample(x, self.resample_mode)
        if self.flavor == "enc":
            if self.conv_skip is not None:
                x = self.conv_skip(x)
            x = normalize(x, dim=1)  # pixel norm on the encoder's main path (Eq. 30)

        y = self.conv_res0(self.silu(x))
        c = self.conditioning(emb)
        y = self.silu(y * c.unsqueeze(2).unsqueeze(3).to(y.dtype))
        if self.training and self.dropout:
            y = F.dropout(y, p=self.dropout)
        y = self.conv_res1(y)

        if self.flavor == "dec" and self.conv_skip is not None:
            x = self.conv_skip(x)
        x = self.add(x, y, t=self.res_balance)

        if self.num_heads:
            x = self.add(x, self._attention(x), t=self.attn_balance)
        if self.clip_act is not None:
            x = x.clip_(-self.clip_act, self.clip_act)
        return x

    def conditioning(self, emb: torch.Tensor) -> torch.Tensor:
        """The residual branch's modulation c [N,C]: 1 + emb_gain W emb (the release's, 'plain'), or with 'double-norm'
        1 + emb_gain normalize(W emb) over the channels, whose deviation from 1 has RMS |emb_gain| however large the
        embedding grows (sCM's adaptive double normalization, Lu and Song 2025, Section 4.1, on the MP block whose
        main path is already pixel-normalized)."""
        if self.modulation == "double-norm":
            return 1 + self.emb_gain * normalize(self.emb_linear(emb), dim=1)
        return self.emb_linear(emb, gain=self.emb_gain) + 1

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        """Cosine self-attention (Eq. 10-12 with pixel-normalized q, k, v; Eq. 30-32)."""
        return self_attention(x, self.attn_qkv, self.attn_proj, self.num_heads, cosine=True)


class TextAttention(torch.nn.Module):
    """Attention of a block's output over a caption's rows (its pooled embedding and tokens), cross or fused
    (edm2.layers.text_attention), added to the block's output by mp_sum (Eq. 88) as the blocks add self-attention."""

    def __init__(self, channels: int, text_dim: int, num_heads: int, kind: str, balance: float):
        super().__init__()
        self.num_heads, self.kind, self.balance = num_heads, kind, balance
        self.q = MPConv(channels, channels * (1 if kind == "cross" else 3), [1, 1])
        self.kv = MPConv(text_dim, 2 * channels, [])
        self.proj = MPConv(channels, channels, [1, 1])

    def forward(self, x: torch.Tensor, text: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [N,C,H,W] attending to text rows [N,T,D] where mask [N,T] is True."""
        y = text_attention(x, text, mask, self.q, self.kv, self.proj, self.num_heads, self.kind)
        return mp_sum(x, y, t=self.balance)


def text_rows(condition: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows a text attention reads from conditions [N, 1+L, D+1]: the pooled embedding and the tokens [N, 1+L, D],
    and their mask [N, 1+L] (the pooled row always on, so that an empty caption still has a key)."""
    pooled, tokens, mask = unpack_condition(condition)
    rows = torch.cat([pooled.unsqueeze(1), tokens], dim=1)
    return rows, torch.cat([torch.ones_like(mask[:, :1]), mask], dim=1)


# The Block arguments that a U-Net passes through (block_kwargs), with their defaults.
_BLOCK_DEFAULTS = {name: inspect.signature(Block).parameters[name].default for name in network_args.BLOCK_ARGS}


class UNet(torch.nn.Module):
    """The magnitude-preserving U-Net of config G (Figure 22); with text_dim, a text network conditioned on a caption's
    condition (edm2.text_condition) by its pooled embedding and, at text_attention's resolutions, attention over its
    tokens (docs/text.md)."""

    # CONFIG G's block, noise features (Eq. 75) and the embedding's and skips' fixed-function layers (Eq. 81, 88,
    # 103); CONFIG F (edm2.architectures.config_f) has its own block and the plain ones.
    block_type = Block
    fourier_type = MPFourier
    silu = staticmethod(mp_silu)
    add = staticmethod(mp_sum)
    cat = staticmethod(mp_cat)

    def __init__(
        self,
        img_resolution: int,
        img_channels: int,
        label_dim: int,
        model_channels: int = 192,
        channel_mult: Sequence[int] = UNetHyperparameters.channel_mult,
        channel_mult_noise: int | None = None,
        channel_mult_emb: int | None = None,
        num_blocks: int = UNetHyperparameters.num_blocks,
        attn_resolutions: Sequence[int] = UNetHyperparameters.attn_resolutions,
        label_balance: float = 0.5,
        concat_balance: float = 0.5,
        text_dim: int = 0,
        text_tokens: int = 0,
        text_attention: Sequence[int] = (),
        text_attention_kind: str = TextUNetHyperparameters.text_attention_kind,
        guidance_embedding: bool = network_args.NETWORK_SWITCHES["guidance_embedding"],
        **block_kwargs,
    ):
        network_args.check_unet(locals(), {**_BLOCK_DEFAULTS, **block_kwargs})  # before anything is built
        network_args.check_text(locals(), block_kwargs.get("channels_per_head", _BLOCK_DEFAULTS["channels_per_head"]))
        super().__init__()
        cblock = [model_channels * m for m in channel_mult]
        cnoise = model_channels * channel_mult_noise if channel_mult_noise is not None else cblock[0]
        cemb = model_channels * channel_mult_emb if channel_mult_emb is not None else max(cblock)
        self.label_dim = label_dim
        self.label_balance, self.concat_balance = label_balance, concat_balance
        # Recompute each block's activations in the backward pass instead of storing them (saves memory).
        self.checkpoint_blocks = False
        self.out_gain = torch.nn.Parameter(torch.zeros([]))

        self.emb_fourier = self.fourier_type(cnoise)
        self.emb_noise = MPConv(cnoise, cemb, [])
        self.emb_label = MPConv(label_dim, cemb, []) if label_dim else None
        self.text_dim = text_dim
        # A caption's pooled embedding enters as a label does (Eq. 88's mp_sum with label_balance).
        self.emb_text = MPConv(text_dim, cemb, []) if text_dim else None
        if text_dim:
            # The empty caption's condition: the unconditional branch of guidance and what text dropout trains.
            self.register_buffer("empty_text", torch.zeros(condition_shape(text_tokens, text_dim)))

        self.enc, self.dec = torch.nn.ModuleDict(), torch.nn.ModuleDict()
        # The input has the constant-1 channel too.
        for slot in unet_layout(img_resolution, img_channels + 1, cblock, num_blocks, attn_resolutions):
            getattr(self, slot.side)[slot.name] = MPConv(slot.in_channels, slot.out_channels, [3, 3]) if slot.conv \
                else self.block_type(slot.in_channels, slot.out_channels, cemb, slot.side, slot.resample_mode,
                                     attention=slot.attention, **block_kwargs)
        self.out_conv = MPConv(cblock[0], img_channels, [3, 3])  # the decoder ends at the first level's width
        self.text_attn = self._text_attention(text_dim, text_attention, text_attention_kind, block_kwargs) \
            if text_dim else None
        # The guidance scale's embedding (sCD's student of a guided teacher), built last so that the layers above draw
        # the same initial weights as without it; its gain starts at zero, so at initialization the network computes
        # exactly the network without it (the teacher it is initialized from).
        self.guidance_embedding = guidance_embedding
        if guidance_embedding:
            self.emb_guidance_fourier = self.fourier_type(cnoise)
            self.emb_guidance = MPConv(cnoise, cemb, [])
            self.guidance_gain = torch.nn.Parameter(torch.zeros([]))

    def _text_attention(self, text_dim: int, resolutions: Sequence[int], kind: str,
                        block_kwargs: dict) -> torch.nn.ModuleDict:
        """A TextAttention after every block (not the resampling ones) at the given resolutions that is at least one
        head wide, keyed 'enc_16x16_block0' etc."""
        per_head = block_kwargs.get("channels_per_head", _BLOCK_DEFAULTS["channels_per_head"])
        balance = block_kwargs.get("attn_balance", _BLOCK_DEFAULTS["attn_balance"])
        layers = torch.nn.ModuleDict()
        for side, blocks in (("enc", self.enc), ("dec", self.dec)):
            for name, block in blocks.items():
                at = isinstance(block, Block) and block.resample_mode == "keep" and block.out_channels >= per_head
                if at and int(name.split("x")[0]) in resolutions:
                    layers[f"{side}_{name}"] = TextAttention(block.out_channels, text_dim,
                                                             block.out_channels // per_head, kind, balance)
        return layers

    def embedding(self, noise_labels: torch.Tensor, class_labels: torch.Tensor | None,
                  guidance: torch.Tensor | float | None = None) -> torch.Tensor:
        """The blocks' conditioning from c_noise and the labels (Eq. 75, 88, 81), in the dtype of noise_labels; with
        guidance_embedding, plus the guidance scale's (1, no guidance, when none is given)."""
        emb = self.emb_noise(self.emb_fourier(noise_labels))
        if self.emb_label is not None:
            # Scaling one-hot labels by sqrt(label_dim) gives them unit magnitude.
            labels = class_labels * math.sqrt(class_labels.shape[1])
            emb = self.add(emb, self.emb_label(labels), t=self.label_balance)
        if self.emb_text is not None:
            # The pooled embedding at unit RMS, whatever the text encoder's scale, as the one-hot labels are.
            pooled = normalize(unpack_condition(class_labels)[0], dim=1).to(emb.dtype)
            emb = self.add(emb, self.emb_text(pooled), t=self.label_balance)
        if self.guidance_embedding:
            emb = emb + self.emb_guidance(self.emb_guidance_fourier(guidance_labels(guidance, noise_labels)),
                                          gain=self.guidance_gain)
        elif guidance is not None:
            raise ArchitectureError("this network has no guidance embedding (guidance_embedding=False): it takes no "
                                    "guidance scale")
        return self.silu(emb)

    def forward(self, x: torch.Tensor, noise_labels: torch.Tensor, class_labels: torch.Tensor | None,
                guidance: torch.Tensor | float | None = None) -> torch.Tensor:
        """Evaluate F(x; c_noise, labels), with guidance_embedding at the guidance scale w (a number or [N]); the
        embedding stays in the dtype of noise_labels."""
        emb = self.embedding(noise_labels, class_labels, guidance)
        text = text_rows(class_labels.expand(x.shape[0], -1, -1)) if self.text_attn else None
        x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        skips = []
        for name, block in self.enc.items():
            x = block(x) if name.endswith("_conv") else self._text(f"enc_{name}", self._block(block, x, emb), text)
            skips.append(x)
        for name, block in self.dec.items():
            if "block" in name:
                x = self.cat(x, skips.pop(), t=self.concat_balance)
            x = self._text(f"dec_{name}", self._block(block, x, emb), text)
        return self.out_conv(x, gain=self.out_gain)

    def _text(self, key: str, x: torch.Tensor, text: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """x after the text attention that follows the block `key`, if it has one."""
        if text is None or key not in self.text_attn:
            return x
        return self.text_attn[key](x, *text)

    def _block(self, block: Block, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """block(x, emb), its activations checkpointed when checkpoint_blocks is on and a gradient is recorded (but
        not under forward-mode AD: the replay in the backward pass would run without the tangents)."""
        tangents = any(forward_ad.unpack_dual(t).tangent is not None for t in (x, emb))
        if not (self.checkpoint_blocks and self.training and torch.is_grad_enabled()) or tangents:
            return block(x, emb)
        # The replay restores the RNG state: dropout draws the same masks. It writes nothing either: the forced
        # weight normalization happens before the forward pass (edm2.layers.force_weight_normalization).
        return torch.utils.checkpoint.checkpoint(block, x, emb, use_reentrant=False)


def guidance_labels(guidance: torch.Tensor | float | None, noise_labels: torch.Tensor) -> torch.Tensor:
    """The guidance embedding's input ln(w) / 4 [N or 1] in the dtype of noise_labels, w = 1 when None: EDM's map of
    sigma to c_noise (Eq. 7), so that equal ratios of scales are equal steps and w = 1 (no guidance) is 0."""
    w = torch.as_tensor(1.0 if guidance is None else guidance, dtype=noise_labels.dtype, device=noise_labels.device)
    return w.reshape(-1).log() / 4


class Precond(torch.nn.Module):
    """EDM preconditioning around a network of a registered family (Eq. 4-8; by default the U-Net, family 'edm2')
    plus the log-variance head u(sigma) (Eq. 21). The family's network is `network`."""

    def __init__(
        self,
        img_resolution: int,
        img_channels: int,
        label_dim: int,
        use_fp16: bool = True,
        use_bf16: bool = False,
        sigma_data: float = 0.5,
        logvar_channels: int = 128,
        family: str = families.DEFAULT_FAMILY,
        time_embedding: str = "edm",
        **network_kwargs,
    ):
        super().__init__()
        network_args.check_precond(sigma_data, logvar_channels, use_fp16, use_bf16, time_embedding)
        self.family = families.get(family)
        self.init_kwargs = dict(
            img_resolution=img_resolution,
            img_channels=img_channels,
            label_dim=label_dim,
            use_fp16=use_fp16,
            use_bf16=use_bf16,
            sigma_data=sigma_data,
            logvar_channels=logvar_channels,
            family=family,
            # Recorded when not EDM's, so that the release's networks keep their constructor arguments.
            **({} if time_embedding == "edm" else dict(time_embedding=time_embedding)),
            **{k: list(v) if isinstance(v, (tuple, list)) else v for k, v in network_kwargs.items()
               if not network_args.is_default_switch(k, v)},
        )
        self.img_resolution = img_resolution
        self.img_channels = img_channels
        self.label_dim = label_dim
        self.use_fp16 = use_fp16
        self.use_bf16 = use_bf16
        self.sigma_data = sigma_data
        self.time_embedding = time_embedding
        # Compute in the 16-bit dtype on the CPU too (bfloat16 on CPUs with bfloat16 units; tests); not saved.
        self.cpu_16bit = False
        # Stored as `unet`, whatever the family: the prefix of every parameter name in the release's pickles and in our
        # snapshots, EMA tracks and training states ('unet.enc...'), which must keep loading.
        self.unet = self.family.constructor(img_resolution, img_channels, label_dim, **network_kwargs)
        self.logvar_fourier = MPFourier(logvar_channels)
        self.logvar_linear = MPConv(logvar_channels, 1, [])

    @property
    def network(self) -> torch.nn.Module:
        """F, the family's network inside the preconditioning."""
        return self.unet

    def compute_dtype(self, device: torch.device, force_fp32: bool = False) -> torch.dtype:
        """The network's activation dtype: 16-bit on CUDA (or with cpu_16bit) when enabled, else base_dtype(); a float64
        network, a reference computation, computes in float64 on every device."""
        base = self.base_dtype()
        if force_fp32 or base == torch.float64 or (device.type != "cuda" and not self.cpu_16bit):
            return base
        if self.use_bf16:
            return torch.bfloat16
        return torch.float16 if self.use_fp16 else base

    def base_dtype(self) -> torch.dtype:
        """The dtype of the inputs, outputs, embedding and log-variance head: float32, or float64 for a network
        converted with .double() (a float64 reference of the same computation)."""
        return torch.promote_types(self.logvar_linear.weight.dtype, torch.float32)

    def prepare_labels(self, class_labels: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """The labels as F takes them: None without labels, all-zero (unconditional) when none are given; for a text
        network conditions [N, 1+L, D+1], the empty caption's when none are given."""
        base = self.base_dtype()
        empty = getattr(self.network, "empty_text", None)
        if empty is not None:
            condition = empty if class_labels is None else class_labels
            return condition.to(device, base).reshape(-1, *empty.shape)
        if self.label_dim == 0:
            return None
        if class_labels is None:
            return torch.zeros([1, self.label_dim], dtype=base, device=device)
        return class_labels.to(base).reshape(-1, self.label_dim)

    def noise_labels(self, sigma: torch.Tensor) -> torch.Tensor:
        """c_noise of noise levels sigma [N]: ln(sigma) / 4 (EDM Eq. 7) or, with time_embedding 'trigflow', the
        TrigFlow time arctan(sigma / sigma_data)."""
        if self.time_embedding == "trigflow":
            return torch.atan(sigma / self.sigma_data)
        return sigma.log() / 4

    def logvar(self, sigma: torch.Tensor) -> torch.Tensor:
        """u(sigma) [N] of noise levels sigma [N] (Eq. 21)."""
        return self.logvar_linear(self.logvar_fourier(self.noise_labels(sigma))).flatten()

    def forward(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor | float,
        class_labels: torch.Tensor | None = None,
        force_fp32: bool = False,
        return_logvar: bool = False,
        guidance: torch.Tensor | float | None = None,
    ):
        """Denoise x at noise level sigma; with return_logvar also return u(sigma) [N,1,1,1]; guidance is the scale
        w (a number or [N]) of a network with a guidance embedding."""
        base = self.base_dtype()
        x = x.to(base)
        sigma = torch.as_tensor(sigma, dtype=base, device=x.device).reshape(-1, 1, 1, 1)
        class_labels = self.prepare_labels(class_labels, x.device)
        dtype = self.compute_dtype(x.device, force_fp32)

        # Preconditioning, Eq. 4-8.
        sd = self.sigma_data
        c_skip = sd**2 / (sigma**2 + sd**2)
        c_out = sigma * sd / (sigma**2 + sd**2).sqrt()
        c_in = 1 / (sd**2 + sigma**2).sqrt()
        c_noise = self.noise_labels(sigma.flatten())

        f_x = self.network((c_in * x).to(dtype), c_noise, class_labels, **network_guidance(guidance))
        d_x = c_skip * x + c_out * f_x.to(base)
        if not return_logvar:
            return d_x
        logvar = self.logvar_linear(self.logvar_fourier(c_noise)).reshape(-1, 1, 1, 1)
        return d_x, logvar

    def unconditional_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels of the unconditional branch of guidance for a batch of labels: the empty caption's condition
        for a text network (what text dropout trains), the all-zero label otherwise (what label dropout trains)."""
        empty = getattr(self.network, "empty_text", None)
        if empty is None:
            return torch.zeros_like(labels)
        return empty.to(labels.device, labels.dtype).expand(labels.shape[0], *empty.shape)


def network_guidance(guidance: torch.Tensor | float | None) -> dict:
    """The keyword arguments that hand a guidance scale to a family's network: none without one, so that the
    families without a guidance embedding are called as they always are."""
    return {} if guidance is None else {"guidance": guidance}


def unet_blocks(unet: UNet) -> list[tuple[str, torch.nn.Module]]:
    """The U-Net's encoder and decoder blocks, named 'enc.16x16_block0' etc., in evaluation order."""
    return [(f"{side}.{name}", block) for side, blocks in (("enc", unet.enc), ("dec", unet.dec))
            for name, block in blocks.items() if isinstance(block, Block)]


UNET = families.register(families.NetworkFamily(
    name=families.DEFAULT_FAMILY, constructor=UNet, blocks=unet_blocks, hyperparameters=TextUNetHyperparameters,
    summary="the magnitude-preserving U-Net of config G (the release's)"))


def count_parameters(net: torch.nn.Module) -> int:
    """Number of trainable parameter elements (works on the meta device)."""
    return sum(p.numel() for p in net.parameters() if p.requires_grad)
