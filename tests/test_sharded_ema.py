"""edm2.runtime.sharded_ema: each rank's part of the EMA tracks, gathered, is bitwise
edm2.phema.PowerFunctionEMA's tracks.

The ranks are simulated in one process: one tracker per rank index, and gather_to_main replaced by the
concatenation of every rank's part, as torch.distributed.gather makes it on rank 0. train_edm2.py --ema-shard
under torchrun is tested in tests/test_train_cli.py.
"""

import pytest
import torch

from edm2.phema import EMAError, PowerFunctionEMA
from edm2.runtime import sharded_ema
from edm2.runtime.distributed import part_bounds
from edm2.runtime.sharded_ema import ShardedPowerFunctionEMA

STDS = (0.05, 0.10)


class Toy(torch.nn.Module):
    """41 parameter elements (a prime: no world size splits them evenly), a channels-last convolution weight
    (memory order differs from the logical order) and a buffer."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))
        self.conv = torch.nn.Parameter(torch.randn(2, 3, 2, 2).contiguous(memory_format=torch.channels_last))
        self.b = torch.nn.Parameter(torch.randn(5))
        self.register_buffer("freqs", torch.randn(6))


def simulated_ranks(monkeypatch, trackers: list[ShardedPowerFunctionEMA]) -> None:
    """Make gather_to_main give rank 0 every tracker's part of the same track, in rank order, and the others None."""
    def gather_to_main(x):
        for rank, tracker in enumerate(trackers):
            for k, shard in enumerate(tracker.shards):
                if shard is x:
                    return torch.cat([t.shards[k] for t in trackers]) if rank == 0 else None
        raise AssertionError("not a shard")

    monkeypatch.setattr(sharded_ema.distributed, "gather_to_main", gather_to_main)


def train(net, trackers, gen) -> None:
    """Random-walk 'optimizer steps' of varying batch sizes, each followed by every tracker's update."""
    nimg = 0
    for batch_size in [8] * 6 + [3, 5]:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=gen))
            net.freqs.add_(1.0)
        nimg += batch_size
        for tracker in trackers:
            tracker.update(cur_nimg=nimg, batch_size=batch_size)


def whole_state(whole: PowerFunctionEMA) -> dict:
    """whole's state_dict() with the network's buffers, which its tracks take at get() and the sharded ones at
    every state_dict() (EDM2's buffers never change)."""
    whole.get()
    return whole.state_dict()


def assert_bitwise_equal(a: dict, b: dict) -> None:
    """Two EMA state dicts hold the same sigma_rel and the same tensors, bit for bit."""
    assert a["stds"] == b["stds"] and len(a["emas"]) == len(b["emas"])
    for x, y in zip(a["emas"], b["emas"]):
        assert list(x) == list(y)
        assert all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


def test_parts_are_tensor_splits():
    for numel in range(10):
        for world_size in range(1, 5):
            sizes = [len(part) for part in torch.arange(numel).tensor_split(world_size)]
            starts = [sum(sizes[:rank]) for rank in range(world_size)]
            assert [part_bounds(numel, world_size, rank) for rank in range(world_size)] == \
                [(start, start + size) for start, size in zip(starts, sizes)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gathered_parts_are_bitwise_the_whole_tracks(world_size, monkeypatch):
    torch.manual_seed(0)
    net = Toy()
    whole = PowerFunctionEMA(net, STDS)
    ranks = [ShardedPowerFunctionEMA(net, STDS, rank=r, world_size=world_size) for r in range(world_size)]
    simulated_ranks(monkeypatch, ranks)
    train(net, [whole, *ranks], torch.Generator().manual_seed(1))

    # Each rank holds its 1/world_size of every track (padded to the longest part), and nothing more.
    assert all(sum(s.numel() for s in t.shards) == len(STDS) * -(-41 // world_size) for t in ranks)
    assert_bitwise_equal(ranks[0].state_dict(), whole_state(whole))
    assert all(t.state_dict() == {} and t.get() == [] for t in ranks[1:])
    for (mine, std), (theirs, their_std) in zip(ranks[0].get(), whole.get()):
        assert std == their_std and not mine.training and not any(p.requires_grad for p in mine.parameters())
        assert all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), theirs.state_dict().values()))
        assert mine.conv.stride() == net.conv.stride()  # the copy keeps the network's layout


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_loading_whole_tracks_keeps_each_ranks_part_and_continues_bitwise(world_size, monkeypatch):
    torch.manual_seed(0)
    net = Toy()
    whole = PowerFunctionEMA(net, STDS)
    gen = torch.Generator().manual_seed(2)
    train(net, [whole], gen)
    ranks = [ShardedPowerFunctionEMA(net, STDS, rank=r, world_size=world_size) for r in range(world_size)]
    simulated_ranks(monkeypatch, ranks)
    for tracker in ranks:
        tracker.load_state_dict(whole_state(whole))
    assert_bitwise_equal(ranks[0].state_dict(), whole_state(whole))
    train(net, [whole, *ranks], gen)
    assert_bitwise_equal(ranks[0].state_dict(), whole_state(whole))


def test_more_ranks_than_elements_leave_some_ranks_nothing(monkeypatch):
    net = torch.nn.Linear(2, 1, bias=False)
    whole = PowerFunctionEMA(net, STDS)
    ranks = [ShardedPowerFunctionEMA(net, STDS, rank=r, world_size=3) for r in range(3)]
    simulated_ranks(monkeypatch, ranks)
    assert [t.pieces for t in ranks] == [[(0, 0, 1)], [(0, 1, 2)], []]
    for nimg in (8, 16):
        with torch.no_grad():
            net.weight.add_(1.0)
        for tracker in [whole, *ranks]:
            tracker.update(cur_nimg=nimg, batch_size=8)
    assert_bitwise_equal(ranks[0].state_dict(), whole_state(whole))


@pytest.mark.bad_input
def test_other_ema_lengths_are_refused():
    net = Toy()
    with pytest.raises(EMAError):
        ShardedPowerFunctionEMA(net, (0.05, 0.5), rank=0, world_size=2)
    tracker = ShardedPowerFunctionEMA(net, STDS, rank=1, world_size=2)
    with pytest.raises(EMAError, match="sigma_rel"):
        tracker.load_state_dict(PowerFunctionEMA(net, (0.05,)).state_dict())
