"""The training's sample grid under the CPU default of two processes: each image is bitwise what a plain generate.py
writes, because the grid is sampled with that command's threads, not with the rank's share of the cores."""

import subprocess
import sys

import numpy as np
import PIL.Image
import torch

from edm2.encoders import StandardRGBEncoder
from edm2.formats import snapshot
from edm2.procedures.image_grid import tile
from training.options import DEFAULT_GRID_STEPS
from training.run import sample_grid
from training.run.sample_grid import GENERATE_THREADS_ENV, SampleGrid, grid_path
from tests.helpers import REPO, tiny_precond, train_command, train_env


def test_the_grid_samples_with_the_threads_of_a_plain_generate_and_restores_the_ranks(tmp_path, monkeypatch):
    # Before: it sampled with the rank's own thread (one, under the two-process default), whose sums may split
    # otherwise than those of generate.py's threads.
    net = tmp_path / "net.safetensors"
    snapshot.save_network(net, tiny_precond(label_dim=0), {"encoder": StandardRGBEncoder().config()})
    seen, real = [], sample_grid.sample_batch

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(sample_grid, "sample_batch", recording)
    monkeypatch.setenv(GENERATE_THREADS_ENV, "2")
    rank_threads = torch.get_num_threads()
    assert rank_threads != 2  # the suite runs on one thread (conftest); otherwise this would prove nothing
    assert SampleGrid(tmp_path / "run", StandardRGBEncoder(), 1, 2, 2, torch.device("cpu")).write(net, 0) is not None
    assert seen == [2] and torch.get_num_threads() == rank_threads


def test_grid_of_a_two_process_run_is_bitwise_what_plain_generate_writes(train_data, tmp_path):
    # The default on a CPU: two processes of one thread each (the cores shared out); generate.py as a user runs it,
    # in the same environment with no OMP_NUM_THREADS of ours.
    env = {name: value for name, value in train_env().items() if name != "OMP_NUM_THREADS"}
    run = tmp_path / "run"
    training = subprocess.run(
        train_command(train_data, run, "--processes=2", "--workers=0", "--duration=512", "--snapshot=512",
                      "--checkpoint=512", "--status=256", "--grid=1x8"),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert training.returncode == 0, training.stdout + training.stderr
    [net] = run.glob("network-snapshot-*-0.050.safetensors")  # the first EMA track's, which the grid shows
    generated = subprocess.run(
        [sys.executable, "generate.py", f"--net={net}", "--seeds=0-7", "--class=0", f"--steps={DEFAULT_GRID_STEPS}",
         f"--outdir={tmp_path / 'out'}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0, generated.stderr
    images = np.stack([np.asarray(PIL.Image.open(tmp_path / "out" / f"{seed:06d}.png")) for seed in range(8)])
    assert np.array_equal(np.asarray(PIL.Image.open(grid_path(run, 512))), tile(images, 8))
