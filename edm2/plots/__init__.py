"""Figures of the paper for any run, drawn with matplotlib without a display; one module per figure family.

Importing this package selects matplotlib's file-only Agg backend, so plots work on clusters and in CI.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")

import matplotlib.figure  # noqa: E402  (after the backend is chosen)

from edm2.runtime import files  # noqa: E402


def new_figure(width: float = 6.4, height: float = 4.8, layout: str | None = "constrained") -> matplotlib.figure.Figure:
    """A figure not registered with pyplot, so drawing many in a long run never accumulates state.

    layout=None leaves the margins to the caller (figure.subplots_adjust): several times faster to save than
    matplotlib's constrained layout, for figures redrawn while a run trains.
    """
    return matplotlib.figure.Figure(figsize=(width, height), layout=layout)


def save_png(figure: matplotlib.figure.Figure, path: str | os.PathLike, dpi: int = 100) -> None:
    """Write the figure as PNG atomically: a reader (or an interrupted run) never sees half an image."""
    with files.atomic_path(path) as tmp, open(tmp, "wb") as f:
        figure.savefig(f, format="png", dpi=dpi)
