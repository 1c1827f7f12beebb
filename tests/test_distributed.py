"""Rank helpers that need no process group."""

import os
import subprocess
import sys

import pytest

from edm2 import distributed
from tests.helpers import REPO, free_port


@pytest.mark.parametrize("num_seeds,batch_size,world_size", [(1, 4, 2), (10, 3, 1), (10, 3, 2), (64, 7, 3), (5, 8, 4)])
def test_rank_batches_cover_every_seed_once(num_seeds, batch_size, world_size):
    seeds = list(range(100, 100 + num_seeds))
    per_rank = [distributed.rank_batches(seeds, batch_size, rank, world_size) for rank in range(world_size)]
    assert len({len(batches) for batches in per_rank}) == 1
    flat = [s for batches in per_rank for b in batches for s in b]
    assert sorted(flat) == seeds
    assert all(len(b) <= batch_size for batches in per_rank for b in batches)


def test_main_rank_first_single_process():
    assert distributed.main_rank_first(lambda: 7) == 7
    with pytest.raises(KeyError):
        distributed.main_rank_first(lambda: {}["missing"])


RANK_FIRST_SCRIPT = """
import os, sys, time
from pathlib import Path
from edm2 import distributed

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
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    started = [float((tmp_path / f"ok-{rank}").read_text()) for rank in (0, 1)]
    assert started[0] < started[1]
    assert (tmp_path / "called-0").exists() and not (tmp_path / "called-1").exists()
    assert [(tmp_path / f"error-{rank}").read_text() for rank in (0, 1)] == ["rank 0 could not fetch it"] * 2
