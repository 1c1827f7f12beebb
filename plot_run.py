"""Redraw a training run's dashboard and magnitude plot from its files: ours as it trains, or one copied from a cluster."""

from __future__ import annotations

from pathlib import Path

import click

from cli.command import Command
from edm2 import files
from training.dashboard import PLOTS_DIR, DashboardError, redraw


@click.command(cls=Command, epilog="""\b
Examples:
  # training.png and magnitudes.png of a run, into training-runs/run/plots/
  python plot_run.py training-runs/run
""")
@click.argument("run", type=click.Path(path_type=Path))
def main(run: Path) -> None:
    """Draw RUN/plots/training.png (loss, learning rate, images/s; loss per noise level and u(sigma)) and
    RUN/plots/magnitudes.png (RMS of block outputs and layer weights against kimg, paper Figure 3).

    Needs only the run's stats.jsonl and the records training keeps in RUN/plots/ (training.json,
    magnitudes.json): no dataset, no snapshot. Training keeps training.png current by itself.
    """
    if not run.is_dir():
        raise click.BadParameter(f"{run} is {'a file' if run.exists() else 'not there'}, not a run directory",
                                 param_hint="RUN")
    try:
        files.check_writable_dir(run / PLOTS_DIR)
        written, notes = redraw(run)
    except (DashboardError, files.OutputError) as e:
        raise click.BadParameter(str(e), param_hint="RUN") from None
    for note in notes:
        click.echo(note)
    for path in written:
        click.echo(f"Saved {path}")


if __name__ == "__main__":
    main()
