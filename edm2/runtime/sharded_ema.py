"""Power-function EMA tracks sharded over the processes of torchrun (paper Eq. 119, 127; edm2.phema).

Each track is the network's float32 parameters, flattened one after another (each in its memory order) into one
vector; that vector is split into world_size contiguous parts as torch.tensor_split splits it, and rank r keeps
and updates part r of every track. Eq. 119's lerp is elementwise, so the parts hold bitwise what the whole tracks
of edm2.phema.PowerFunctionEMA hold; they are gathered on rank 0 only when a snapshot or training state is written.
"""

from __future__ import annotations

import torch

from edm2.phema import PowerFunctionEMA, check_saved_stds, inference_copy, power_function_beta, tracked_stds
from edm2.runtime import distributed


def overlaps(sizes: list[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """(tensor index, first, end) of each piece of the concatenated tensors of these sizes within [start, stop)."""
    pieces, offset = [], 0
    for index, size in enumerate(sizes):
        first, end = max(start - offset, 0), min(stop - offset, size)
        if first < end:
            pieces.append((index, first, end))
        offset += size
    return pieces


def memory_order(t: torch.Tensor) -> list[int]:
    """t's dimensions from the slowest-varying in memory to the fastest (channels-last weights are not in order)."""
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def flat(t: torch.Tensor, order: list[int]) -> torch.Tensor:
    """t's elements as one vector in the memory order of a parameter laid out as `order` says: a view of that
    parameter (and of any tensor laid out alike), a copy of a tensor laid out otherwise."""
    return t.permute(order).reshape(-1)


class ShardedPowerFunctionEMA:
    """PowerFunctionEMA's interface and tracks, holding on each rank only its part of every track (module doc).

    update() and load_state_dict() are local; get() and state_dict() are collectives that every rank must call:
    rank 0 receives what PowerFunctionEMA would return, the other ranks nothing ([] and {}), and the gathered
    copies are the caller's, freed when it drops them. Buffers are not averaged: each gathered copy takes the
    network's (PowerFunctionEMA's take them at get(); EDM2's never change).
    """

    @torch.no_grad()
    def __init__(self, net: torch.nn.Module, stds: tuple[float, ...] = (0.050, 0.100), rank: int | None = None,
                 world_size: int | None = None):
        self.net = net
        self.stds = tracked_stds(stds)
        self.world_size = distributed.get_world_size() if world_size is None else world_size
        self.rank = distributed.get_rank() if rank is None else rank
        params = list(net.parameters())
        self.names = [name for name, _ in net.named_parameters()]
        self.orders = [memory_order(p) for p in params]
        self.sizes = [p.numel() for p in params]
        self.pieces = overlaps(self.sizes, *distributed.part_bounds(sum(self.sizes), self.world_size, self.rank))
        # Every rank's part padded to the longest, so that the parts gather as equal tensors.
        part = -(-sum(self.sizes) // self.world_size)
        self.shards = [torch.zeros([part], dtype=torch.float32, device=params[0].device) for _ in self.stds]
        self.views = [_split(shard, self.pieces) for shard in self.shards]
        if self.pieces:  # the tracks start as the network's weights
            src = self._source()
            for views in self.views:
                torch._foreach_copy_(views, src)

    def _source(self) -> list[torch.Tensor]:
        """This rank's pieces of the network's parameters: views of float32 parameters, float32 copies of others."""
        params = list(self.net.parameters())
        pieces = [flat(params[index], self.orders[index])[first:end] for index, first, end in self.pieces]
        return [p if p.dtype == torch.float32 else p.float() for p in pieces]

    @torch.no_grad()
    def update(self, cur_nimg: int, batch_size: int) -> None:
        """Fold in this rank's part of the network's current parameters after a step that brought the image count
        to cur_nimg: one foreach lerp per track, with the whole tracks' beta."""
        if not self.pieces:  # a network with fewer elements than ranks leaves some ranks nothing
            return
        src = self._source()
        for std, views in zip(self.stds, self.views):
            beta = power_function_beta(std=std, t_next=cur_nimg, t_delta=batch_size)  # Eq. 127
            torch._foreach_lerp_(views, src, 1 - beta)  # Eq. 119

    @torch.no_grad()
    def get(self) -> list[tuple[torch.nn.Module, float]]:
        """Rank 0: the averaged networks with their sigma_rel, buffers from the network; other ranks: []."""
        tracks = []
        for shard, std in zip(self.shards, self.stds):
            gathered = distributed.gather_to_main(shard)
            if gathered is not None:
                tracks.append((self._assemble(gathered.view(self.world_size, -1)), std))
        return tracks

    def _assemble(self, parts: torch.Tensor) -> torch.nn.Module:
        """A float32 copy of the network whose parameters are the parts of every rank [world_size, padded part]."""
        ema = inference_copy(self.net)
        params = list(ema.parameters())
        for rank, part in enumerate(parts):
            pieces = overlaps(self.sizes, *distributed.part_bounds(sum(self.sizes), self.world_size, rank))
            if pieces:
                dst = [flat(params[index], self.orders[index])[first:end] for index, first, end in pieces]
                torch._foreach_copy_(dst, _split(part, pieces))
        return ema

    def state_dict(self) -> dict:
        """Rank 0: PowerFunctionEMA.state_dict() of the gathered tracks, to resume with any number of ranks,
        sharded or not; other ranks: {}."""
        tracks = self.get()
        return {"stds": list(self.stds), "emas": [ema.state_dict() for ema, _ in tracks]} if tracks else {}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Keep this rank's part of whole tracks saved by either tracker's state_dict(); the sigma_rel must match."""
        check_saved_stds(state, self.stds)
        for views, saved in zip(self.views, state["emas"]):
            for view, (index, first, end) in zip(views, self.pieces):
                view.copy_(flat(saved[self.names[index]], self.orders[index])[first:end])


def _split(vector: torch.Tensor, pieces: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Consecutive views of vector, one per piece, each as long as the piece."""
    return list(vector[:sum(end - first for _, first, end in pieces)].split([end - first for _, first, end in pieces]))


def power_function_ema(net: torch.nn.Module, stds: tuple[float, ...], shard: bool) -> \
        PowerFunctionEMA | ShardedPowerFunctionEMA:
    """The EMA tracker of a training: sharded over the ranks when shard is set and there are several, else whole."""
    if shard and distributed.get_world_size() > 1:
        return ShardedPowerFunctionEMA(net, stds)
    return PowerFunctionEMA(net, stds)
