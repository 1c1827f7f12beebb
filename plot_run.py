"""Redraw a training run's dashboard and magnitude plot from its files: ours as it trains, or one copied from a cluster."""

from __future__ import annotations

import cli.wait_policy  # noqa: F401  first: PyTorch's OpenMP reads its wait policy once, when it loads
from pathlib import Path

import click

from cli.command import Command
from edm2.runtime import files
from training.run.dashboard import PLOTS_DIR, DashboardError, redraw
from training.run.run_dir import RunDirectoryError
from training.run.tensorboard_import import write_tensorboard
from training.run.trackers import TENSORBOARD_DIR, TrackerUnavailable, check_installed


@click.command(cls=Command, epilog="""\b
Examples:
  # training.png and magnitudes.png of a run, into training-runs/run/plots/
  python plot_run.py training-runs/run
""")
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--tensorboard", is_flag=True, help="Instead, write RUN/tensorboard/'s event file from the run's "
              "records (stats.jsonl, plots/*.json, samples/); needs the tensorboard extra")
def main(run: Path, tensorboard: bool) -> None:
    """Draw RUN/plots/training.png (loss, learning rate, images/s; loss per noise level and u(sigma)) and
    RUN/plots/magnitudes.png (RMS of block outputs and layer weights against kimg, paper Figure 3).

    Needs only the run's stats.jsonl and the records training keeps in RUN/plots/ (training.json,
    magnitudes.json): no dataset, no snapshot. Training keeps training.png current by itself.

    --tensorboard writes, from the same records and the sample grids, the events `train_edm2.py
    --logger=tensorboard` logs, replacing for TensorBoard what RUN/tensorboard/ held: browse runs from before
    the trackers, or copied from a cluster, with `tensorboard --logdir RUN/tensorboard`.
    """
    if not run.is_dir():
        raise click.BadParameter(f"{run} is {'a file' if run.exists() else 'not there'}, not a run directory",
                                 param_hint="RUN")
    if tensorboard:
        write_events(run)
        return
    try:
        files.check_writable_dir(run / PLOTS_DIR)
        written, notes = redraw(run)
    except (DashboardError, files.OutputError) as e:
        raise click.BadParameter(str(e), param_hint="RUN") from None
    for note in notes:
        click.echo(note)
    for path in written:
        click.echo(f"Saved {path}")


def write_events(run: Path) -> None:
    """plot_run.py --tensorboard: the event file, or one line saying why not."""
    try:
        check_installed("tensorboard")
    except TrackerUnavailable as e:
        raise click.BadParameter(str(e), param_hint="--tensorboard") from None
    try:
        files.check_writable_dir(run / TENSORBOARD_DIR)
        path = write_tensorboard(run)
    except (DashboardError, RunDirectoryError, files.OutputError) as e:
        raise click.BadParameter(str(e), param_hint="RUN") from None
    except OSError as e:  # a full disk: nothing of the file is left
        raise click.BadParameter(f"{e.filename}: cannot write ({e.strerror or e})", param_hint="RUN") from None
    click.echo(f"Saved TensorBoard events in {path}")


if __name__ == "__main__":
    main()
