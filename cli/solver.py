"""The --solver and --schedule options of the commands that sample (generate.py, calculate_metrics.py gen and sweep),
read from the solver table (edm2.solvers.SOLVERS) and the schedule table (edm2.schedules.SCHEDULES)."""

from __future__ import annotations

import click

from cli.types import TableChoice
from edm2.schedules import SCHEDULES
from edm2.solvers import SOLVERS

DEFAULT_SOLVER, DEFAULT_SCHEDULE = "heun", "edm"  # the release's


def _evaluations(per_step: int) -> str:
    """A solver's network evaluations for --steps=N, in words."""
    return "N" if per_step == 1 else f"{per_step}N-{per_step - 1}"


solver_option = click.option(
    "--solver", type=TableChoice(SOLVERS), default=DEFAULT_SOLVER, show_default=True,
    help="Solver of the steps between the --schedule's noise levels (network evaluations for --steps=N): " + ", ".join(
        f"{name} ({solver.about}; {_evaluations(solver.evaluations_per_step)})" for name, solver in SOLVERS.items()))

schedule_option = click.option(
    "--schedule", type=TableChoice(SCHEDULES), default=DEFAULT_SCHEDULE, show_default=True,
    help="Noise levels of the steps, from sigma_max down to sigma_min, then 0: " + ", ".join(
        f"{name} ({schedule.about})" for name, schedule in SCHEDULES.items()))


def recorded(solver: str, schedule: str) -> dict:
    """The solver and schedule as a sweep's results file records them: only those other than the release's, so
    that the files from before either option stay resumable (and a file of another one refuses, or is refused)."""
    return {**({} if solver == DEFAULT_SOLVER else {"solver": solver}),
            **({} if schedule == DEFAULT_SCHEDULE else {"schedule": schedule})}
