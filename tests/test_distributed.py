"""Rank helpers that need no process group."""

import pytest

from edm2 import distributed


@pytest.mark.parametrize("num_seeds,batch_size,world_size", [(1, 4, 2), (10, 3, 1), (10, 3, 2), (64, 7, 3), (5, 8, 4)])
def test_rank_batches_cover_every_seed_once(num_seeds, batch_size, world_size):
    seeds = list(range(100, 100 + num_seeds))
    per_rank = [distributed.rank_batches(seeds, batch_size, rank, world_size) for rank in range(world_size)]
    assert len({len(batches) for batches in per_rank}) == 1
    flat = [s for batches in per_rank for b in batches for s in b]
    assert sorted(flat) == seeds
    assert all(len(b) <= batch_size for batches in per_rank for b in batches)
