"""torch.compile's inductor options for our compiles: on the CPU, its C++ wrapper; for a training graph, also a
graph pass that decides how its backward gets the masks it needs."""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy


class RecomputeCPUMasks(CustomGraphPass):
    """Joint-graph pass: every boolean tensor the CPU computes is recomputed in the backward pass, not saved from the
    forward one.

    The gradients of clip (each block's clamp at clip_act = 256, as in the release's networks_edm2.py) and of the
    norms' guard against zero multiply by masks. Left to itself, the partitioner saves such a mask: at one byte an
    element it is the smallest thing to keep. But the CPU code torch 2.13 generates stores and loads boolean vectors
    element by element (at::vec has no vectorized bool path): on 2 threads of a Xeon, 1.3 ms to store and 2.3 ms to
    load 1M elements, where comparing the activation again takes 0.1 ms. Tagged must-recompute (the selective
    checkpointing tag that the partitioner honours), the masks are compared inside the backward kernels, from the
    saved activation or its recomputed inputs. Where the saved activation is rounded to the compute dtype (as eager
    rounds it), a mask can differ from the forward pass's unrounded comparison, for values within one rounding of
    the bound. CUDA's kernels handle booleans natively and are left as they are.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        """Tag the graph's CPU boolean values for recomputation."""
        for node in graph.nodes:
            value = node.meta.get("val")
            if (node.op == "call_function" and isinstance(value, torch.Tensor) and value.dtype == torch.bool
                    and value.device.type == "cpu"):
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE

    def uuid(self) -> bytes:
        """This file's hash: inductor's graph cache keys on it, so cached graphs are rebuilt when the pass changes."""
        return get_hash_for_files((__file__,))


def device_options(device: torch.device) -> dict[str, object]:
    """torch.compile's inductor options for any graph on device: on the CPU, the C++ wrapper."""
    # The wrapper calls the graph's few hundred kernels and library calls one after the other; inductor writes it in
    # Python unless told otherwise. Written in C++ on 2 threads of a Xeon (bf16, channels-last, batch 32 at 32x32,
    # each pair of variants alternating in one process or in fresh processes): the toy-tiny and toy-small
    # training steps ran 3-4% faster (median 495 -> 514 and 237 -> 243 images/s) and toy-tiny's sampling 4-9%,
    # for no more compile time. On CUDA it was not measured, so CUDA graphs keep inductor's default.
    return {"cpp_wrapper": True} if device.type == "cpu" else {}


def training_options(device: torch.device) -> dict[str, object]:
    """torch.compile's inductor options for a training graph on device: device_options, and RecomputeCPUMasks
    after the joint graph's own passes."""
    return {**device_options(device), "joint_custom_post_pass": RecomputeCPUMasks()}
