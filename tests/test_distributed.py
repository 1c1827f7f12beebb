"""Rank helpers: batches per rank, and rank 0 going first; a failed rank reported once, by its own line."""

import os
import subprocess
import sys

import click
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cli import local_launch
from cli.command import LAUNCHER_ENV, LOST_PEER_STATUS, Command
from edm2.procedures.generation import SeedRanges
from edm2.runtime import distributed
from edm2.runtime.distributed import free_port
from tests.helpers import REPO


@pytest.mark.parametrize("num_seeds,batch_size,world_size", [(1, 4, 2), (10, 3, 1), (10, 3, 2), (64, 7, 3), (5, 8, 4)])
def test_rank_batches_cover_every_seed_once(num_seeds, batch_size, world_size):
    seeds = list(range(100, 100 + num_seeds))
    per_rank = [distributed.rank_batches(seeds, batch_size, rank, world_size) for rank in range(world_size)]
    assert len({len(batches) for batches in per_rank}) == 1
    flat = [s for batches in per_rank for b in batches for s in b]
    assert sorted(flat) == seeds
    assert all(len(b) <= batch_size for batches in per_rank for b in batches)


def array_split_batches(items, batch_size, rank, world_size):
    """Today's assignment, written with NumPy: num_batches near-equal parts, every world_size-th to a rank."""
    num_batches = max(int(np.ceil(len(items) / (batch_size * world_size))), 1) * world_size
    return [[int(i) for i in part] for part in np.array_split(np.asarray(items, dtype=np.int64), num_batches)[rank::world_size]]


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("batch_size", [1, 2, 5, 32])
def test_rank_batches_are_numpys_array_split(batch_size, world_size):
    # The same assignment as before rank_batches became lazy, so every image lands where it did.
    for num_items in [0, 1, 2, 7, 31, 64, 100, 257]:
        items = list(range(1000, 1000 + 3 * num_items, 3))
        for rank in range(world_size):
            expected = array_split_batches(items, batch_size, rank, world_size)
            for same_items in (items, np.asarray(items), range(1000, 1000 + 3 * num_items, 3)):
                batches = distributed.rank_batches(same_items, batch_size, rank, world_size)
                assert list(batches) == expected and len(batches) == len(expected)
                assert batches[-1] == expected[-1] and batches[1:3] == expected[1:3]
            kept = distributed.rank_batches(items, batch_size, rank, world_size, skip_empty=True)
            assert list(kept) == [b for b in expected if b]


def test_rank_batches_of_all_32_bit_seeds_are_computed_one_at_a_time():
    seeds = SeedRanges([range(0, 1 << 32)])
    batches = distributed.rank_batches(seeds, 32, 5, 8)
    assert len(batches) == (1 << 32) // (32 * 8)
    assert batches[0] == list(range(5 * 32, 6 * 32))
    assert batches[-1] == list(range((1 << 32) - 3 * 32, (1 << 32) - 2 * 32))


def test_main_rank_first_single_process():
    assert distributed.main_rank_first(lambda: 7) == 7
    with pytest.raises(KeyError):
        distributed.main_rank_first(lambda: {}["missing"])


RANK_FIRST_SCRIPT = """
import os, sys, time
from pathlib import Path
from edm2.runtime import distributed

distributed.init()
rank, log = distributed.get_rank(), Path(sys.argv[1])

def work(fail):
    with open(log / f"called-{rank}", "w") as f:
        f.write(str(time.monotonic()))
    if fail:
        raise ValueError("rank 0 could not fetch it")
    return rank

assert distributed.main_rank_first(lambda: work(False)) == rank
(log / f"called-{rank}").rename(log / f"ok-{rank}")
try:
    distributed.main_rank_first(lambda: work(True))
except ValueError as e:
    (log / f"error-{rank}").write_text(str(e))
distributed.shutdown()
"""


def test_main_rank_first_two_processes(tmp_path):
    # Rank 1 runs only after rank 0 has finished; when rank 0 fails, rank 1 raises its error uncalled.
    script = tmp_path / "rank_first.py"
    script.write_text(RANK_FIRST_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--master_port={free_port()}", str(script), str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    started = [float((tmp_path / f"ok-{rank}").read_text()) for rank in (0, 1)]
    assert started[0] < started[1]
    assert (tmp_path / "called-0").exists() and not (tmp_path / "called-1").exists()
    assert [(tmp_path / f"error-{rank}").read_text() for rank in (0, 1)] == ["rank 0 could not fetch it"] * 2


def test_more_processes_than_gpus_is_refused_in_one_line_before_the_group_forms(monkeypatch):
    # torchrun --nproc_per_node=2 on a one-GPU machine: CUDA would raise "invalid device ordinal" in rank 1 while
    # rank 0 waited for it at the rendezvous.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kwargs: pytest.fail("the group formed"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    for call in (distributed.init, distributed.device):
        with pytest.raises(distributed.DistributedError, match=r"1 GPU\(s\) visible; .*--nproc_per_node=1"):
            call()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert distributed.device() == torch.device("cuda", 0)


@pytest.mark.parametrize("launcher", [False, True])
def test_a_rank_that_lost_its_group_is_silent_under_our_launcher(launcher, monkeypatch):
    # cli.local_launch names the rank that failed; the others, which only lost it, add nothing (Gloo's line, before).
    @click.command(cls=Command)
    def collective():
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234. GLHF!")

    if launcher:
        monkeypatch.setenv(LAUNCHER_ENV, "1")
    else:
        monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    result = CliRunner().invoke(collective, [])
    if launcher:
        assert (result.exit_code, result.output) == (LOST_PEER_STATUS, "")
    else:
        assert result.exit_code == 1 and result.output.startswith("Error: another process of this run ended (")


# A rank that fails after a while, printing why as it ends (rank 0), and one that ends at once, having lost it (rank 1).
LATE_FAILURE = f"""
import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit({LOST_PEER_STATUS})
time.sleep(1.0)
print("Error: the cause", file=sys.stderr, flush=True)
sys.exit(1)
"""


def test_the_launcher_waits_for_the_failed_rank_behind_one_that_only_lost_it(capfd):
    # Before: the rank that lost its group ended first, counted as the failure, and the one still printing why was
    # killed: no error line at all.
    assert local_launch.run_ranks([sys.executable, "-c", LATE_FAILURE], 2, 1) == 1
    assert capfd.readouterr().err.splitlines() == ["Error: the cause"]
