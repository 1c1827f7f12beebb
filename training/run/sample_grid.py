"""Sample grids while training: at every snapshot, rank 0 samples a fixed grid from the snapshot just written
(first EMA track) and writes RUN/samples/grid-{images_tag}.png atomically.

The grid has ROWS x COLS images; image (r, c) has seed r * COLS + c and, for a class-conditional network, the
class r % label_dim, so each row is one class. Every image is what `generate.py --no-compile --net=SNAPSHOT
--seeds=... --class=r%label_dim --steps=STEPS` writes for its seed (on the CPU, where nothing compiles by default,
plain generate.py); edm2.procedures.image_grid.tile joins them as generate.py --grid does. A CPU kernel may split a
sum by threads, so the grid is sampled with the threads a plain generate.py computes with here (generate_threads),
not the rank's: under the two-process CPU default each rank has one thread of the cores shared out.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from edm2.errors import one_line
from edm2.formats.snapshot import images_tag, load_network
from edm2.procedures.generation import sample_batch
from edm2.procedures.image_grid import save_png, tile
from edm2.runtime import files
from edm2.runtime.speed import SamplingSpeed

SAMPLES_DIR = "samples"
# The threads of a plain `python generate.py` in the user's environment, which cli.local_launch gives its ranks: they
# themselves run with the cores shared out among them (OMP_NUM_THREADS).
GENERATE_THREADS_ENV = "EDM2_GENERATE_THREADS"
_START_THREADS = torch.get_num_threads()  # PyTorch's own at import, before a command's --threads applies


def generate_threads() -> int:
    """The CPU threads a plain generate.py computes with in the user's environment: $EDM2_GENERATE_THREADS where the
    launcher set it, else this process's own at its start."""
    given = os.environ.get(GENERATE_THREADS_ENV, "")
    return int(given) if given.isdigit() and int(given) > 0 else _START_THREADS


@contextlib.contextmanager
def cpu_threads(threads: int) -> Iterator[None]:
    """PyTorch computes with `threads` CPU threads inside, with those it had after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def grid_path(run_dir: Path, nimg: int) -> Path:
    """RUN/samples/grid-{images_tag(nimg)}.png, named like the snapshots of the same image count."""
    return run_dir / SAMPLES_DIR / f"grid-{images_tag(nimg)}.png"


def row_class(row: int, label_dim: int) -> int | None:
    """The class of a grid row: the labels in turn; None for an unconditional network."""
    return row % label_dim if label_dim else None


def grid_classes(rows: int, label_dim: int) -> str:
    """Which classes a grid of `rows` rows shows, when that is not every class of a label_dim-class network; ''
    when it is (or the network is unconditional)."""
    if not label_dim or rows >= label_dim:
        return ""
    return (f"The sample grids show classes 0-{rows - 1} of {label_dim} (one per row); --grid={label_dim}xCOLS "
            "shows every class.")


def sample_grid(net: torch.nn.Module, encoder, rows: int, cols: int, steps: int, device: torch.device) -> np.ndarray:
    """The grid of a network as one HWC uint8 image, sampled as one batch on this process alone."""
    classes = [row_class(i // cols, net.label_dim) for i in range(rows * cols)] if net.label_dim else None
    images = sample_batch(net, encoder, range(rows * cols), classes, device, num_steps=steps)[0]
    return tile(images.permute(0, 2, 3, 1).cpu().numpy(), cols)


class SampleGrid:
    """Rank 0's grid writer; one that fails (a VAE that cannot load, a full disk) warns once and writes no more."""

    def __init__(self, run_dir: Path, encoder, rows: int, cols: int, steps: int, device: torch.device):
        self.run_dir, self.encoder, self.rows, self.cols, self.steps = run_dir, encoder, rows, cols, steps
        self.device = device
        self.failed = False
        files.remove_stale_temporaries(run_dir / SAMPLES_DIR, owned=True)

    def write(self, snapshot: Path, nimg: int) -> np.ndarray | None:
        """Sample the grid of a snapshot file, write it as the grid of nimg, and return it; None once failed."""
        if self.failed:
            return None
        try:
            net = load_network(snapshot)[0].to(self.device)
            # generate.py's defaults but no compile: a new network at every snapshot would compile again each time.
            SamplingSpeed(compile=False).apply(net, self.device)
            with cpu_threads(generate_threads()):
                grid = sample_grid(net, self.encoder, self.rows, self.cols, self.steps, self.device)
            save_png(grid_path(self.run_dir, nimg), grid)
        except Exception as e:  # a preview must never stop the training it shows
            print(f"Warning: the sample grid failed ({type(e).__name__}: {one_line(e)}); training goes on without "
                  f"grids.", flush=True)
            self.failed = True
            return None
        return grid
