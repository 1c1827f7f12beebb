"""The data order: a Feistel permutation per epoch in O(1) memory, one global sample sequence whatever the world size
(a run stopped on 2 Gloo ranks and resumed on 1 or 4 reads what the uninterrupted run read), blends, and the stored
permutation that training states written before the Feistel order keep reading."""

import json
import multiprocessing

import numpy as np
import pytest
import torch

from edm2.data import shard_writer
from edm2.data.permutation import FeistelPermutation
from edm2.data.sources import open_data
from edm2.runtime import distributed
from training.data_order import DataOrder, order_for, run_batches
from training.options import rounds_per_step
from training.state import TrainingState
from tests.helpers import toy_tiny_options


@pytest.mark.parametrize("size", [1, 2, 3, 5, 16, 17, 100, 255, 256, 1000, 4097])
def test_feistel_permutation_is_a_permutation(size):
    for key in range(3):
        values = FeistelPermutation(size, 7, key)(np.arange(size))
        assert sorted(values.tolist()) == list(range(size))


def test_feistel_permutation_needs_no_memory_of_the_size():
    # 10**12 items: a stored permutation would take 8 TB; the Feistel one computes any index alone.
    permutation = FeistelPermutation(10**12, 0, 0)
    positions = np.array([0, 1, 10**12 - 1, 123456789012])
    values = permutation(positions)
    assert ((values >= 0) & (values < 10**12)).all() and len(set(values.tolist())) == 4
    assert np.array_equal(values[[2, 0]], permutation(positions[[2, 0]]))  # a function of the index alone
    assert not np.array_equal(values, FeistelPermutation(10**12, 1, 0)(positions))  # the seed moves it


def test_each_epoch_is_a_fresh_permutation_looking_uniform():
    # Where item 0 lands over 1600 epochs of 8 items: each position about 200 times (chi-square, 7 dof).
    landing = [int(np.argmax(FeistelPermutation(8, 3, e)(np.arange(8)) == 0)) for e in range(1600)]
    counts = np.bincount(landing, minlength=8)
    assert ((counts - 200) ** 2 / 200).sum() < 24.3  # chi-square with 7 dof: p = 0.001


def test_states_written_before_the_feistel_order_keep_the_stored_permutation():
    state = TrainingState.create(toy_tiny_options(run_dir="unused", data="unused"), 3, torch.device("cpu"))
    saved = state.to_dict()
    assert saved["data_order"] == "feistel"
    del saved["data_order"]  # a state written before the order was recorded
    state.load(saved)
    assert state.data_order == "permutation"
    # What DataOrder read before this change: position p reads default_rng([seed, epoch]).permutation(N)[p % N].
    order = DataOrder(7, 5, 0, 1, 4, 0, kind=state.data_order)
    before = [int(np.random.default_rng([5, p // 7]).permutation(7)[p % 7]) for p in range(30)]
    assert [order.index(p) for p in range(30)] == before


# ----------------------------------------------------------------------------------------------
# One global sequence at any world size: ranks forked here join a Gloo group and read through run_batches.

BATCH, BATCH_GPU, SEED = 12, 3, 11


def write_id_shards(path, count, first_id):
    """Shards whose sample i shows its id (first_id + i) in its pixels, so that what a loader read can be read off."""
    ids = first_id + np.arange(count)
    pixels = np.zeros((count, 3, 4, 4), np.uint8)
    pixels[:, 0], pixels[:, 1] = (ids % 256)[:, None, None], (ids // 256)[:, None, None]
    index = shard_writer.new_index("pixels", [3, 4, 4], 0, count, {"ids": first_id}, shard_size=5)
    shard_writer.write_shards(path, index, lambda k, first, n: (pixels[first:first + n], None))
    return path


def read_ids(images):
    return (images[:, 0, 0, 0].long() + 256 * images[:, 1, 0, 0].long()).tolist()


def rank_reads(rank, world_size, port, spec, start_nimg, steps, out):
    distributed.describe_local_launch(rank, world_size, port)
    distributed.init(backend="gloo")
    batch_gpu, rounds = rounds_per_step(BATCH, BATCH_GPU, world_size)
    with run_batches(open_data(spec), SEED, start_nimg, batch_gpu, 0, torch.device("cpu")) as batches:
        mine = [[read_ids(next(batches)[0]) for _ in range(rounds)] for _ in range(steps)]
    everyone = distributed.all_gather_object(mine)
    if rank == 0:  # the global sequence: each step's rounds, each round's ranks in turn
        sequence = [i for step in range(steps) for r in range(rounds) for reads in everyone for i in reads[step][r]]
        out.write_text(json.dumps(sequence))
    distributed.shutdown()


def consumed(spec, world_size, start_nimg, steps, out):
    """The ids a run of world_size forked Gloo ranks reads in `steps` steps from start_nimg on, in global order."""
    port, context = distributed.free_port(), multiprocessing.get_context("fork")
    ranks = [context.Process(target=rank_reads, args=(r, world_size, port, spec, start_nimg, steps, out))
             for r in range(world_size)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(120)
    assert [process.exitcode for process in ranks] == [0] * world_size
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("order")
    return write_id_shards(root / "base.shards", 37, 0), write_id_shards(root / "fine.shards", 11, 1000)


@pytest.mark.parametrize("blended", [False, True], ids=["shards", "blend"])
def test_stopped_on_2_ranks_resumed_on_1_or_4_reads_the_uninterrupted_sequence(sources, tmp_path, blended):
    spec = f"{sources[0]}:3,{sources[1]}:1" if blended else str(sources[0])
    whole = consumed(spec, 2, 0, 7, tmp_path / "whole.json")
    stopped = consumed(spec, 2, 0, 3, tmp_path / "stopped.json")
    assert stopped == whole[:3 * BATCH]
    for world_size in (1, 4):
        resumed = consumed(spec, world_size, 3 * BATCH, 4, tmp_path / f"resumed-{world_size}.json")
        assert stopped + resumed == whole, world_size
    # The sequence is the order's function of the position: none read twice within an epoch, none skipped.
    dataset = open_data(spec)
    order = order_for(dataset, SEED, 0, 1, BATCH, 0)
    ids = [read_ids(torch.from_numpy(dataset[order.index(p)][0][None]))[0] for p in range(7 * BATCH)]
    assert whole == ids
    epoch = sum(dataset.segments) if blended else len(dataset)
    if not blended:
        assert sorted(whole[:epoch]) == list(range(37))
    else:  # 3:1 of 48 per blend epoch: 36 of base (all 37 but one) and 12 of fine (all 11 and one again)
        first = whole[:epoch]
        assert sum(i < 1000 for i in first) == 36 and len(set(i for i in first if i < 1000)) == 36
        assert sorted(set(i for i in first if i >= 1000)) == list(range(1000, 1011))
