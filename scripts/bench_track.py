"""What the sample grids and the experiment trackers cost a training: the time spent inside them over the whole run.

One training runs in this process with --logger=tensorboard --logger=wandb (W&B offline, its files in a
temporary folder) and the preset's snapshot interval; the time inside the grid writer (loading the snapshot,
sampling, decoding, the PNG) and inside the trackers (setup, every log, flush and close) is measured directly,
since on a shared machine two whole runs differ by more than these cost. Example:

    python scripts/bench_track.py --data=demo-out/toy.zip --duration=16Ki
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent


def timed(cls: type, names: tuple[str, ...], spent: list[float]) -> None:
    """Wrap the methods `names` of cls so that the seconds spent in them add up in spent[0]."""
    for name in names:
        def wrapper(self, *args, _inner=getattr(cls, name), **kwargs):
            # Seconds spent inside methods during one training, summed: not a callable timed on its own.
            start = time.perf_counter()
            try:
                return _inner(self, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        setattr(cls, name, wrapper)


@click.command()
@click.option("--data", required=True, help="Dataset (the demo's demo-out/toy.zip)")
@click.option("--preset", default="toy-small", show_default=True, help="Training preset")
@click.option("--duration", default=None, help="Training duration (images)  [default: the preset's]")
@click.option("--grid", default=None, help="--grid of the training  [default: train_edm2.py's]")
@click.option("--grid-steps", default=None, help="--grid-steps of the training  [default: train_edm2.py's]")
def main(data: str, preset: str, duration: str | None, grid: str | None, grid_steps: str | None) -> None:
    """Train once with both trackers and a sample grid at every snapshot; print their shares of the time."""
    sys.path.insert(0, str(REPO))
    import train_edm2
    from training.run import sample_grid, trackers

    grid_s, trackers_s, logging_s = [0.0], [0.0], [0.0]
    timed(sample_grid.SampleGrid, ("__init__", "write"), grid_s)
    timed(trackers.Trackers, ("__init__", "close"), trackers_s)
    timed(trackers.Trackers, ("log", "flush"), logging_s)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(WANDB_MODE="offline", WANDB_DIR=tmp, WANDB_SILENT="true")
        args = [f"--preset={preset}", f"--data={data}", "--workers=0", f"--outdir={tmp}/run",
                "--logger=tensorboard", "--logger=wandb"]
        args += [f"--{name}={value}" for name, value in (("duration", duration), ("grid", grid),
                                                         ("grid-steps", grid_steps)) if value is not None]
        start = time.perf_counter()
        train_edm2.main(args, standalone_mode=False)
        total = time.perf_counter() - start
        grids = len(list(Path(tmp, "run", sample_grid.SAMPLES_DIR).glob("grid-*.png")))
    trackers_s[0] += logging_s[0]
    print(f"training {total:.1f} s; {grids} sample grids {grid_s[0]:.2f} s ({100 * grid_s[0] / total:.2f}%); "
          f"trackers {trackers_s[0]:.2f} s ({100 * trackers_s[0] / total:.2f}%), of which logging, not starting "
          f"and closing, {logging_s[0]:.2f} s ({100 * logging_s[0] / total:.2f}%)", flush=True)


if __name__ == "__main__":
    main()
