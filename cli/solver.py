"""The --solver option of the commands that sample (generate.py, calculate_metrics.py gen and sweep), read from the
solver table (edm2.solvers.SOLVERS)."""

from __future__ import annotations

import click

from cli.types import TableChoice
from edm2.solvers import SOLVERS


def _evaluations(per_step: int) -> str:
    """A solver's network evaluations for --steps=N, in words."""
    return "N" if per_step == 1 else f"{per_step}N-{per_step - 1}"


solver_option = click.option(
    "--solver", type=TableChoice(SOLVERS), default="heun", show_default=True,
    help="ODE solver on the same noise levels (network evaluations for --steps=N): " + ", ".join(
        f"{name} ({solver.about}; {_evaluations(solver.evaluations_per_step)})" for name, solver in SOLVERS.items()))
