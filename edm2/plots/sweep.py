"""The EMA-length sweep (paper Figure 5a, c): each metric against sigma_rel, one curve per training time, the
best EMA length of each curve marked; over guidance strengths too (Figure 14), against either."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import matplotlib.figure

from edm2 import plots
from edm2.eval.scores import higher_is_better
from edm2.eval.sweep import best_rows

# Plain text, no mathtext.
LABELS = {"loss": "validation loss (Eq. 14)", "fid": "FID", "fd_dinov2": "FD_DINOv2", "kid": "KID"}


def sweep_figure(rows: Sequence[dict], metrics: Sequence[str]) -> matplotlib.figure.Figure:
    """One panel per metric: metric against sigma_rel for every training time in rows, the minimum starred."""
    figure = plots.new_figure(5 * len(metrics), 4)
    times = sorted({row["nimg"] for row in rows})
    for index, metric in enumerate(metrics):
        ax = figure.add_subplot(1, len(metrics), index + 1)
        best = best_rows(rows, metric)
        for k, nimg in enumerate(times):
            curve = sorted((row["std"], row[metric]) for row in rows if row["nimg"] == nimg and metric in row)
            color = f"C{k % 10}"
            ax.plot([s for s, _ in curve], [v for _, v in curve], "o-", color=color, markersize=3,
                    label=f"kimg {nimg // 1000}")
            if nimg in best:
                row = best[nimg]
                ax.plot([row["std"]], [row[metric]], "*", color=color, markersize=14, markeredgecolor="black")
                ax.annotate(f"{row['std']:.3f}", (row["std"], row[metric]), textcoords="offset points",
                            xytext=(0, 9), ha="center", fontsize=8)
        ax.set(xlabel="EMA length σ_rel", ylabel=LABELS.get(metric, metric), title=f"{metric} against EMA length")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return figure


def _panels(rows: Sequence[dict], metrics: Sequence[str], x: str, line: str, xlabel: str,
            name: Callable[[float], str]) -> matplotlib.figure.Figure:
    """One panel per metric: the metric against row[x], one line per distinct row[line], each line's best value
    starred (the lowest; the highest for precision and the like)."""
    figure = plots.new_figure(5 * len(metrics), 4)
    for index, metric in enumerate(metrics):
        ax = figure.add_subplot(1, len(metrics), index + 1)
        for k, key in enumerate(sorted({row[line] for row in rows})):
            curve = sorted((row[x], row[metric]) for row in rows if row[line] == key and metric in row)
            color = f"C{k % 10}"
            ax.plot([a for a, _ in curve], [v for _, v in curve], "o-", color=color, markersize=3, label=name(key))
            finite = [(a, v) for a, v in curve if math.isfinite(v)]
            if finite:
                a, v = (max if higher_is_better(metric) else min)(finite, key=lambda point: point[1])
                ax.plot([a], [v], "*", color=color, markersize=12, markeredgecolor="black")
        ax.set(xlabel=xlabel, ylabel=LABELS.get(metric, metric), title=f"{metric} against {xlabel.rsplit(' ', 1)[0]}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return figure


def ema_guidance_figure(rows: Sequence[dict], metrics: Sequence[str]) -> matplotlib.figure.Figure:
    """Each metric against sigma_rel, one line per guidance strength (paper Figure 14); rows of one training time."""
    return _panels(rows, metrics, "std", "guidance", "EMA length σ_rel", lambda g: f"guidance {g:g}")


def guidance_figure(rows: Sequence[dict], metrics: Sequence[str]) -> matplotlib.figure.Figure:
    """Each metric against guidance strength, one line per sigma_rel; rows of one training time."""
    return _panels(rows, metrics, "guidance", "std", "guidance strength w", lambda s: f"σ_rel {s:.3f}")


def tensor_sweep_figure(rows: Sequence[dict], metric: str, std: float) -> matplotlib.figure.Figure:
    """Figure 5b: metric against sigma_rel, the whole network thick and one faint curve per tensor swept alone
    (the others at the global length std, marked)."""
    figure = plots.new_figure(6, 4.5)
    ax = figure.add_subplot(1, 1, 1)
    tensors = list(dict.fromkeys(row["tensor"] for row in rows if row["tensor"] is not None))
    for k, name in enumerate(tensors):
        curve = sorted((row["std"], row[metric]) for row in rows if row["tensor"] == name)
        ax.plot([s for s, _ in curve], [v for _, v in curve], "-", color=f"C{k % 10}", alpha=0.45, linewidth=1,
                label=name.removeprefix("unet.") if len(tensors) <= 12 else None)
    whole = sorted((row["std"], row[metric]) for row in rows if row["tensor"] is None)
    ax.plot([s for s, _ in whole], [v for _, v in whole], "o-", color="black", linewidth=2.5, markersize=3,
            label="whole network")
    ax.axvline(std, color="gray", linestyle=":", linewidth=1)
    ax.set(xlabel="EMA length σ_rel", ylabel=LABELS.get(metric, metric),
           title=f"one tensor at a time, the others at σ_rel {std:.3f}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    return figure
