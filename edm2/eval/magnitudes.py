"""Activation and weight magnitudes of an EDM2 network (paper Figure 3, Appendix A.6), for plots over training.

A magnitude here is an RMS, sqrt(mean(x^2)) over all elements: 1 for unit-normal values whatever their shape
(Eq. 3 before the per-feature aggregation). Activations are the outputs of the blocks the network's family names
(edm2.families.NetworkFamily.blocks; the U-Net's encoder and decoder blocks); weights are each learned layer's
raw stored weight, before the normalization applied on use (Eq. 47).
"""

from __future__ import annotations

import math

import torch

from edm2.networks import Precond


def bucket(name: str) -> str:
    """The paper's grouping of a block or layer: 'enc 16x16', 'dec 8x8', or the name's first part elsewhere."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] in ("enc", "dec"):
        return f"{parts[0]} {parts[1].split('_')[0]}"
    return parts[0]


@torch.no_grad()
def block_output_rms(net: Precond, x: torch.Tensor, sigma: torch.Tensor,
                     labels: torch.Tensor | None) -> dict[str, float]:
    """RMS of each block's output when net denoises x at sigma, keyed as its family names them ('enc.16x16_block0'
    etc.), in order."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def record(name: str):
        def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            sums[name] = output.detach().to(torch.float64).square().sum()
            counts[name] = output.numel()
        return hook

    blocks = net.family.blocks(net.network)
    _forward_hooked(net, [(m, record(name)) for name, m in blocks], x, sigma, labels)
    return {name: math.sqrt(float(sums[name]) / counts[name]) for name, _ in blocks if name in sums}


def _forward_hooked(net: torch.nn.Module, hooked: list, x: torch.Tensor, sigma: torch.Tensor,
                    labels: torch.Tensor | None) -> None:
    """One evaluation of net with each (module, forward hook) of hooked registered for it alone."""
    handles = [module.register_forward_hook(hook) for module, hook in hooked]
    try:
        net(x, sigma, labels)
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def weight_rms(net: torch.nn.Module) -> dict[str, float]:
    """RMS of each learned layer's raw weight (a module's parameter named 'weight'), keyed by module name less 'unet.'
    ('enc.16x16_block0.conv_res0')."""
    return {name.removeprefix("unet."): float(m.weight.detach().to(torch.float64).square().mean().sqrt())
            for name, m in net.named_modules() if isinstance(getattr(m, "weight", None), torch.nn.Parameter)}


def _learned(net: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The U-Net's encoder and decoder layers with a learned weight (Appendix A.6: biases and gains left out)."""
    return [(name.removeprefix("unet."), m) for name, m in net.named_modules()
            if isinstance(getattr(m, "weight", None), torch.nn.Parameter) and m.weight.ndim >= 2
            and name.removeprefix("unet.").split(".")[0] in ("enc", "dec")]


@torch.no_grad()
def bucket_magnitudes(net: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor,
                      labels: torch.Tensor | None) -> dict[str, dict[str, dict[str, float]]]:
    """Appendix A.6 (Figure 15): per resolution bucket, the max and the mean over features of Eq. 3's per-feature
    magnitudes, {'activations': {bucket: {'max', 'mean'}}, 'weights': ...}. An activation feature is one output
    channel of a learned layer, its RMS over the batch and pixels (after any bias, before any nonlinearity); a
    weight feature is one output row of the raw stored weight."""
    layers = _learned(net)
    squares: dict[str, list[torch.Tensor]] = {}

    def record(name: str):
        def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            out = output.detach().to(torch.float64)
            dims = [d for d in range(out.ndim) if d != 1]
            squares.setdefault(bucket(name), []).append(out.square().mean(dim=dims).sqrt())
        return hook

    _forward_hooked(net, [(m, record(name)) for name, m in layers], x, sigma, labels)
    rows: dict[str, list[torch.Tensor]] = {}
    for name, m in layers:
        rows.setdefault(bucket(name), []).append(m.weight.detach().to(torch.float64).flatten(1).square().mean(1).sqrt())
    return {kind: {b: {"max": float(torch.cat(v).max()), "mean": float(torch.cat(v).mean())} for b, v in found.items()}
            for kind, found in (("activations", squares), ("weights", rows))}
