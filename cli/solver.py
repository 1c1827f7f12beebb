"""The --solver option of the commands that sample (generate.py, calculate_metrics.py gen and sweep)."""

from __future__ import annotations

import click

from edm2.sampler import SOLVERS

solver_option = click.option(
    "--solver", type=click.Choice(SOLVERS), default="heun", show_default=True,
    help="ODE solver on the same noise levels: heun (the release's; 2 x steps - 1 network evaluations), euler or "
         "dpm2m (DPM-Solver++(2M)), steps evaluations each")
