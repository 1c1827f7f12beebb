"""Floating-point operations of one evaluation of an EDM2 network, counted as the release's count_flops.py counts them.

The release traces `net(x, sigma, labels)` for one sample and prices every traced aten op from its shapes
(paper Appendix D.5): a convolution or matrix product costs its output elements times the reduced length
(a multiply-accumulate is ONE flop); an elementwise op costs its output elements, times 2 for lerp and clamp_,
times 3 for silu and softmax; linalg_vector_norm costs its input elements; views, casts, cat, unbind and
constants cost nothing. Paper Table 6's "gigaflops" are these totals for the img512 models.

Our network computes some of the same functions with other kernels than the release's network, so tracing
ours would price different ops. We therefore do not trace: `count_flops` walks the network's modules and
adds up what the release's network (training/networks_edm2.py) executes for the same architecture:

- resampling: the release's 'down' is a depthwise conv2d with the normalized 2x2 box filter at stride 2 and
  its 'up' a depthwise conv_transpose2d with that filter times 4 (a mul on the 4-element filter), each
  costing 4 per output element; ours uses avg_pool2d and repeat_interleave.
- attention: the release divides k by sqrt(channels per head), multiplies q^T k as a matmul, takes an
  explicit softmax and multiplies by v; ours calls scaled_dot_product_attention.
- MPConv: the release normalizes its weight on every call, also in eval mode (linalg_vector_norm, add of
  eps, div, mul by gain / sqrt(fan_in), plus a div for a learned gain); ours normalizes once per sampler run
  (edm2.layers.weights_normalized_once).
- everything else is the same op for op: mp_silu (silu, div), mp_sum (lerp, div), mp_cat (two muls),
  pixel norm (linalg_vector_norm, add, div), clip_ (clamp_), the Fourier embedding (outer, add, cos, mul)
  and the preconditioning (16 scalar ops, c_in * x, c_skip * x + c_out * F_x).

Like the release, the log-variance head (not evaluated by `net(x, sigma, labels)`) is not counted, but its
weights are among the parameters. The totals agree with the per-op figures the paper gives for XXL
(Appendix D.5: convolutions 545.50, linalg_vector_norm 1.54, matmul 1.43 Gflops).
"""

from __future__ import annotations

import collections
import dataclasses
import math

import torch

from edm2.networks import Block, Precond

# The release's preconditioning on the [1,1,1,1] sigma, one flop per op: c_skip (pow, add, reciprocal, mul),
# c_out (mul, pow, add, sqrt, div), c_in (pow, add, sqrt, reciprocal, mul) and c_noise (log, div).
_SCALAR_OPS = {"pow": 3, "add": 3, "reciprocal": 2, "mul": 3, "sqrt": 2, "div": 2, "log": 1}


# Flops of one part of the network by the release's op name ('_convolution', 'matmul', 'div', ...).
Cost = collections.Counter

# The ops whose flops are multiply-accumulates (each counted as one flop, as the release counts).
MAC_OPS = ("_convolution", "matmul")


@dataclasses.dataclass
class FlopsCount:
    """Parameters and the flops of one evaluation for one sample, per part of the network in evaluation order."""

    parameters: int
    parts: dict[str, Cost]

    @property
    def total(self) -> int:
        """Flops of one evaluation of one sample."""
        return sum(self.by_op().values())

    def by_op(self) -> Cost:
        """Flops of the whole evaluation by op name."""
        return sum(self.parts.values(), Cost())


def _mpconv(cost: Cost, weight: torch.Tensor, out_elements: int, learned_gain: bool = False) -> None:
    """The release's MPConv in eval mode: weight normalization on every call, then the convolution or matmul."""
    w = weight.numel()
    cost["linalg_vector_norm"] += w
    cost["add"] += weight.shape[0]  # eps, one per output channel
    cost["div"] += w  # w / norm
    cost["mul"] += w  # w * (gain / sqrt(fan_in))
    # The trace records fan_in = w[0].numel() as a 0-d tensor, so gain / sqrt(fan_in) is a tensor op too: a div
    # for a learned gain (a tensor), a reciprocal and a mul for the constant gain 1.
    if learned_gain:
        cost["div"] += 1
    else:
        cost["reciprocal"] += 1
        cost["mul"] += 1
    cost["matmul" if weight.ndim == 2 else "_convolution"] += out_elements * math.prod(weight.shape[1:])


def _mp_silu(cost: Cost, elements: int) -> None:
    cost["silu"] += 3 * elements
    cost["div"] += elements


def _mp_sum(cost: Cost, elements: int) -> None:
    cost["lerp"] += 2 * elements
    cost["div"] += elements


def _normalize(cost: Cost, elements: int, norms: int) -> None:
    """normalize(): linalg_vector_norm of the input, add of eps to each norm, div."""
    cost["linalg_vector_norm"] += elements
    cost["add"] += norms
    cost["div"] += elements


def _attention(cost: Cost, block: Block, channels: int, pixels: int) -> None:
    """The release's cosine self-attention (einsums as matmuls, explicit softmax) and its mp_sum."""
    heads = block.num_heads
    cost["mul"] += 1  # the token count height * width, a product of traced sizes
    _mpconv(cost, block.attn_qkv.weight, 3 * channels * pixels)
    _normalize(cost, 3 * channels * pixels, heads * 3 * pixels)  # q, k, v over each head's channels
    cost["div"] += channels * pixels  # k / sqrt(channels per head)
    cost["matmul"] += 2 * channels * pixels * pixels  # q^T k, then the weighted sum of v; all heads
    cost["softmax"] += 3 * heads * pixels * pixels
    _mpconv(cost, block.attn_proj.weight, channels * pixels)
    _mp_sum(cost, channels * pixels)


def _block(block: Block, channels_in: int, resolution: int) -> tuple[Cost, int]:
    """Cost of one encoder or decoder block (paper Figure 21) for its input size; returns it and the output
    resolution."""
    cost = Cost()
    out = block.out_channels
    if block.resample_mode == "down":
        resolution //= 2
        cost["_convolution"] += 4 * channels_in * resolution**2  # depthwise 2x2 box filter, stride 2
    elif block.resample_mode == "up":
        resolution *= 2
        cost["mul"] += 4  # the 2x2 filter times 4
        cost["_convolution"] += 4 * channels_in * resolution**2  # depthwise transposed, stride 2
    pixels = resolution**2
    if block.flavor == "enc":
        if block.conv_skip is not None:
            _mpconv(cost, block.conv_skip.weight, out * pixels)
        _normalize(cost, out * pixels, pixels)  # pixel norm over channels
    _mp_silu(cost, (out if block.flavor == "enc" else channels_in) * pixels)
    _mpconv(cost, block.conv_res0.weight, out * pixels)
    _mpconv(cost, block.emb_linear.weight, out, learned_gain=True)
    cost["add"] += out  # c = emb_linear(emb) + 1
    cost["mul"] += out * pixels  # y * c
    _mp_silu(cost, out * pixels)
    _mpconv(cost, block.conv_res1.weight, out * pixels)
    if block.flavor == "dec" and block.conv_skip is not None:
        _mpconv(cost, block.conv_skip.weight, out * pixels)
    _mp_sum(cost, out * pixels)
    if block.num_heads:
        _attention(cost, block, out, pixels)
    if block.clip_act is not None:
        cost["clamp_"] += 2 * out * pixels
    return cost, resolution


def _embedding(net: Precond) -> Cost:
    """The noise (and class) embedding of one sample: Fourier features, linear layers, mp_sum, mp_silu."""
    unet, cost = net.unet, Cost()
    noise_channels, emb_channels = unet.emb_fourier.freqs.numel(), unet.emb_noise.weight.shape[0]
    for op in ("outer", "add", "cos", "mul"):  # y = c_noise outer freqs + phases; cos(y) * sqrt(2)
        cost[op] += noise_channels
    _mpconv(cost, unet.emb_noise.weight, emb_channels)
    if unet.emb_label is not None:
        cost["mul"] += net.label_dim  # labels * sqrt(label_dim)
        _mpconv(cost, unet.emb_label.weight, emb_channels)
        _mp_sum(cost, emb_channels)
    _mp_silu(cost, emb_channels)
    return cost


def count_flops(net: Precond) -> FlopsCount:
    """Parameters (all of them) and flops of `net(x, sigma, labels)` for one sample as the release counts them;
    works on the meta device."""
    unet = net.unet
    image = net.img_channels * net.img_resolution**2
    # c_in * x; then c_skip * x + c_out * F_x.
    parts = {"precond": Cost(_SCALAR_OPS) + Cost(mul=3 * image, add=image), "embedding": _embedding(net)}
    channels, resolution, skips = net.img_channels + 1, net.img_resolution, []
    for name, block in unet.enc.items():
        if isinstance(block, Block):
            parts[f"enc.{name}"], resolution = _block(block, channels, resolution)
            channels = block.out_channels
        else:  # the first 3x3 convolution
            parts[f"enc.{name}"] = cost = Cost()
            channels = block.weight.shape[0]
            _mpconv(cost, block.weight, channels * resolution**2)
        skips.append(channels)
    for name, block in unet.dec.items():
        concat = 0
        if "block" in name:
            channels += skips.pop()
            concat = channels * resolution**2
        parts[f"dec.{name}"], resolution = _block(block, channels, resolution)
        if concat:
            # mp_cat with the skip connection: its two weights are 0-d tensors in the trace (a div and a mul
            # each), then one mul per element of either part.
            parts[f"dec.{name}"].update(div=2, mul=2 + concat)
        channels = block.out_channels
    parts["out_conv"] = Cost()
    _mpconv(parts["out_conv"], unet.out_conv.weight, image, learned_gain=True)
    return FlopsCount(sum(p.numel() for p in net.parameters()), parts)


def memory_per_sample(net: Precond, device: torch.device) -> int:
    """Peak CUDA memory (bytes) that one evaluation of one sample allocates beyond the weights, on `device`."""
    x = torch.zeros([1, net.img_channels, net.img_resolution, net.img_resolution], device=device)
    labels = torch.zeros([1, net.label_dim], device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.no_grad():
        net(x, torch.ones([1], device=device), labels)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
