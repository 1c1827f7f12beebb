"""Floating-point operations of one evaluation of an EDM2 network, counted as the release's count_flops.py counts them.

The release traces `net(x, sigma, labels)` for one sample and prices every traced aten op from its shapes
(paper Appendix D.5): a convolution or matrix product costs its output elements times the reduced length
(a multiply-accumulate is ONE flop); an elementwise op costs its output elements, times 2 for lerp and clamp_,
times 3 for silu and softmax; linalg_vector_norm costs its input elements; views, casts, cat, unbind and
constants cost nothing. Paper Table 6's "gigaflops" are these totals for the img512 models.

`count_flops` runs the network itself, of whatever family, on the meta device (shapes only, no arithmetic) under
a torch function mode that prices each call by those rules: the network's own code is the one description of
what it computes. Where our code computes a function with another kernel than the release's, the call is priced
as the release's kernel:

- the magnitude-preserving primitives of edm2.layers, which take part in torch function dispatch, are priced
  whole: resample as the release's depthwise box-filter convolution (stride 2) or transposed convolution (with
  its filter times 4), 4 per output element; mp_cat with the two weights the release's trace computes as 0-d
  tensors (a div and a mul each) besides its two muls; normalize, mp_silu and mp_sum op for op.
- attention (scaled-dot-product attention on CUDA) as the release's: k divided by sqrt(channels per head), q^T k and
  the weighted sum of v as matmuls, an explicit softmax, and the token count height * width (a traced product).
- an MPConv with the constant gain 1: the release's trace computes gain / sqrt(fan_in) as a reciprocal and a mul
  of 0-d tensors (a learned gain's div is a tensor op here too).

Like the release, the log-variance head (not evaluated by `net(x, sigma, labels)`) is not counted, but its weights
are among the parameters. The totals agree with Table 6 and with the per-op figures the paper gives for XXL
(Appendix D.5: convolutions 545.50, linalg_vector_norm 1.54, matmul 1.43 Gflops).

A sampled image costs its sampler's evaluations times that (sampling_evaluations): a consistency model one per
step, a diffusion model its solver's evaluations of its steps (edm2.solvers.evaluations).

Not torch.utils.flop_counter: it counts 2 per multiply-accumulate and no elementwise op (edm2.runtime.utilization).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from edm2 import layers
from edm2.consistency_sampler import is_consistency_model
from edm2.networks import Precond
from edm2.solvers import evaluations

# Flops of one part of the network by the release's op name ('_convolution', 'matmul', 'div', ...).
Cost = collections.Counter

# The ops whose flops are multiply-accumulates (each counted as one flop, as the release counts).
MAC_OPS = ("_convolution", "matmul")

# Elementwise calls by name: (the release's op name, flops per output element).
_ELEMENTWISE = {
    "add": ("add", 1), "__add__": ("add", 1), "__radd__": ("add", 1), "mul": ("mul", 1), "__mul__": ("mul", 1),
    "__rmul__": ("mul", 1), "div": ("div", 1), "__truediv__": ("div", 1), "__div__": ("div", 1), "pow": ("pow", 1),
    "__pow__": ("pow", 1), "sqrt": ("sqrt", 1), "log": ("log", 1), "cos": ("cos", 1), "outer": ("outer", 1),
    "lerp": ("lerp", 2), "clip_": ("clamp_", 2), "clamp_": ("clamp_", 2), "silu": ("silu", 3),
}


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


def _elements(t: torch.Tensor) -> int:
    return t.numel()


def _primitive_cost(func: Callable, args: tuple, kwargs: dict, out: torch.Tensor) -> Cost | None:
    """The release's cost of one of edm2.layers' primitives; None for any other call."""
    if func is layers.normalize:
        return Cost(linalg_vector_norm=_elements(args[0]), add=out.numel() // _norm_length(args, kwargs),
                    div=out.numel())
    if func is layers.mp_silu:
        return Cost(silu=3 * out.numel(), div=out.numel())
    if func is layers.mp_sum:
        return Cost(lerp=2 * out.numel(), div=out.numel())
    if func is layers.mp_cat:
        return Cost(div=2, mul=2 + out.numel())
    if func is layers.attention:
        q, k = args[0], args[1]  # [N, heads, channels, tokens]
        per_head, tokens, k_tokens = q.shape[-2], q.shape[-1], k.shape[-1]
        rows = q.numel() // (per_head * tokens)
        return Cost(mul=1, div=k.numel(), matmul=2 * rows * per_head * tokens * k_tokens,
                    softmax=3 * rows * tokens * k_tokens)
    if func is layers.resample:
        mode = kwargs.get("mode", "keep")
        return Cost() if mode == "keep" else Cost(_convolution=4 * out.numel(), mul=4 if mode == "up" else 0)
    return None


def _norm_length(args: tuple, kwargs: dict) -> int:
    """How many elements each norm of normalize(x, dim) reduces."""
    x, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else None)
    dims = range(1, x.ndim) if dim is None else [dim] if isinstance(dim, int) else dim
    return math.prod(x.shape[d] for d in dims)


def _torch_cost(func: Callable, args: tuple, kwargs: dict, out: object) -> Cost:
    """The release's cost of a torch call from its shapes; calls the release's rules do not price cost nothing."""
    name = getattr(func, "__name__", "")
    if name in _ELEMENTWISE and isinstance(out, torch.Tensor):
        op, factor = _ELEMENTWISE[name]
        return Cost({op: factor * out.numel()})
    if name in ("__rdiv__", "__rtruediv__", "reciprocal"):  # a / t is traced as reciprocal(t) * a
        return Cost(reciprocal=out.numel(), mul=out.numel() if name != "reciprocal" else 0)
    if name == "conv2d":
        return Cost(_convolution=out.numel() * math.prod(args[1].shape[1:]))
    if name in ("__matmul__", "matmul", "mm", "bmm"):
        return Cost(matmul=out.numel() * args[0].shape[-1])
    if name == "linear":
        return Cost(matmul=out.numel() * args[1].shape[1])
    return Cost()


class _Pricer(TorchFunctionMode):
    """Adds the release's cost of every call to the part of the network being evaluated."""

    def __init__(self, parts: dict[str, Cost], stack: list[str]):
        super().__init__()
        self.parts, self.stack = parts, stack

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        cost = _primitive_cost(func, args, kwargs, out)
        self.parts.setdefault(self.stack[-1], Cost()).update(cost if cost is not None else
                                                             _torch_cost(func, args, kwargs, out))
        return out


def _parts(net: Precond) -> list[tuple[str, torch.nn.Module]]:
    """The parts a count reports: the family's blocks, and the other modules of the network holding weights or
    buffers of their own outside the blocks (embeddings, first and last layers)."""
    blocks = net.family.blocks(net.network)
    inside = {id(m) for _, block in blocks for m in block.modules()}
    others = [(name, m) for name, m in net.network.named_modules() if id(m) not in inside
              and (next(m.parameters(recurse=False), None) is not None or next(m.buffers(recurse=False), None) is not None)
              and m is not net.network]
    return blocks + others


def _hooks(net: Precond, stack: list[str], parts: dict[str, Cost]) -> list:
    """Hooks that name the part being evaluated, and add the release's gain artifact of each MPConv with gain 1."""
    hooks = []
    for name, module in [("unet", net.network), *_parts(net)]:
        hooks.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
        hooks.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))

    def constant_gain(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not isinstance(kwargs.get("gain", args[1] if len(args) > 1 else 1), torch.Tensor):
            parts.setdefault(stack[-1], Cost()).update(reciprocal=1, mul=1)

    hooks += [m.register_forward_pre_hook(constant_gain, with_kwargs=True) for m in layers.mpconvs(net.network)]
    return hooks


def count_flops(net: Precond) -> FlopsCount:
    """Parameters (all of them) and flops of `net(x, sigma, labels)` for one sample as the release counts them, from
    a run of a copy of the network built on the meta device (no weights, no arithmetic)."""
    with torch.device("meta"):
        shadow = Precond(**net.init_kwargs).eval()
        x = torch.zeros([1, net.img_channels, net.img_resolution, net.img_resolution])
        labels = torch.zeros([1, net.label_dim])
        sigma = torch.ones([1])
    stack, parts = ["precond"], {}
    hooks = _hooks(shadow, stack, parts)
    try:
        with torch.no_grad(), torch.device("meta"), _Pricer(parts, stack):
            shadow(x, sigma, labels)
    finally:
        for hook in hooks:
            hook.remove()
    parts = {name: cost for name, cost in parts.items() if +cost}
    return FlopsCount(sum(p.numel() for p in net.parameters()), parts)


def sampling_evaluations(metadata: dict, steps: int, solver: str) -> int:
    """Network evaluations (NFE) per image of `steps` sampling steps of the network whose snapshot's metadata is
    given: one per step for a consistency model, else the solver's (the guiding network's, if any, come on top)."""
    return steps if is_consistency_model(metadata) else evaluations(solver, steps)


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
