"""The run dashboard (loss, learning rate, speed; Eq. 21's halves per noise level) and magnitudes over training
(paper Figure 3), drawn from the plain data that training/run/dashboard.py records."""

from __future__ import annotations

import math

import matplotlib
import matplotlib.colors
import matplotlib.figure
import matplotlib.ticker
import numpy as np

from edm2 import plots
from edm2.eval.magnitudes import bucket
from edm2.loss import DEFAULT_UNCERTAINTY, UNCERTAINTIES

# No mathtext anywhere: plain-text labels, and plain tick labels on log axes (matplotlib's default ones are
# mathtext). Its parser (pyparsing) leaves reference cycles of exceptions and their tracebacks, which keep the
# frames of whoever drew the figure until the garbage collector runs; in a training those frames hold the data
# loader, whose worker processes then kept the interpreter from exiting at the end of the run.
PLAIN = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
# A curve's y axis spans at least this fraction of its largest |value|: a learning rate that is constant up to
# rounding, or images/s that jitter by 1%, read as flat lines, not as swings across the whole panel.
MIN_RELATIVE_SPAN = 0.1
# Titles just above their axes, where matplotlib puts them when nothing is drawn above a panel: given, not found,
# since finding it measures each axis's ticks at every draw (a quarter of the dashboard's drawing time).
TITLE_Y = 1.0
# Blocks of one level share its colour, each a shade lighter than the one before, up to this mix with white.
MAX_SHADE = 0.6


def dashboard_figure(data: dict) -> matplotlib.figure.Figure:
    """Training curves against kimg (data['stats']) and, when recorded, the newest snapshot's loss per noise level.

    data['noise_levels'] rows hold, per sigma of data['sigma'], lambda(sigma) L(D; sigma) ('weighted_error')
    and the learned u(sigma) ('u'); the panels show Eq. 21's halves lambda/e^u L and u, and u against ln(lambda L).
    A run trained with the uncertainty off (data['uncertainty'], learned when absent) has no u: its loss is
    lambda L (Eq. 14), drawn alone.
    """
    learned = UNCERTAINTIES[data.get("uncertainty", DEFAULT_UNCERTAINTY)].learned
    figure = plots.new_figure(11, 6.5, layout=None)  # redrawn at every snapshot: fixed margins save time
    axes = figure.subplot_mosaic([["loss", "loss", "lr", "lr", "speed", "speed"],
                                  ["halves", "halves", "halves", "fit", "fit", "fit"]])
    figure.subplots_adjust(left=0.06, right=0.98, top=0.95, bottom=0.08, hspace=0.35, wspace=1.2)
    stats = data["stats"]
    loss_title = "training loss (Eq. 21)" if learned else "training loss (λL, Eq. 14; uncertainty off)"
    for key, name, label, ylabel in (("loss", "loss", loss_title, "loss"),
                                     ("lr", "lr", "learning rate (Eq. 67)", "learning rate"),
                                     ("speed", "images_per_s", "images/s", "images/s")):
        ax = axes[key]
        ax.plot(stats["kimg"], stats[name], color="C0", linewidth=1)
        ax.set(xlabel="kimg", ylabel=ylabel)
        ax.set_title(label, y=TITLE_Y)
        keep_span(ax, stats[name])
        for i, resume in enumerate(data.get("resumes") or []):  # where an interrupted run went on
            ax.axvline(resume["kimg"], color="0.5", linestyle=":", linewidth=1, label="resumed" if i == 0 else None)
        if data.get("resumes"):
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    newest_mfu = [v for v in stats.get("mfu", []) if v is not None][-1:]
    if newest_mfu:  # the model-FLOP utilisation of the newest status line
        axes["speed"].text(0.98, 0.04, f"MFU {newest_mfu[0]:.1%}", transform=axes["speed"].transAxes, ha="right",
                           va="bottom", fontsize=8)
    rows = data.get("noise_levels") or []
    if rows:
        _noise_level_panels(axes["halves"], axes["fit"], data, rows[-1], learned)
    else:
        for key in ("halves", "fit"):
            axes[key].text(0.5, 0.5, "no noise-level records in this run", ha="center", va="center",
                           transform=axes[key].transAxes)
            axes[key].set_axis_off()
    return figure


def metrics_figure(rows: list[dict]) -> matplotlib.figure.Figure:
    """One panel per metric of the rows ({kimg, metrics: {name: value}}) against kimg (train_edm2.py --metrics)."""
    names = list(dict.fromkeys(name for row in rows for name in row["metrics"]))
    figure = plots.new_figure(3.5 * max(len(names), 1), 3)
    for index, name in enumerate(names):
        ax = figure.add_subplot(1, len(names), index + 1)
        points = [(row["kimg"], row["metrics"][name]) for row in rows if name in row["metrics"]]
        ax.plot([k for k, _ in points], [v for _, v in points], "o-", color=f"C{index % 10}", markersize=3)
        ax.set(xlabel="kimg", title=name)
        ax.grid(alpha=0.3)
    return figure


def keep_span(ax, values) -> None:
    """Widen the y axis around the values to at least MIN_RELATIVE_SPAN of their largest magnitude."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return
    low, high = min(finite), max(finite)
    span = MIN_RELATIVE_SPAN * max(abs(low), abs(high))
    if high - low < span:
        middle = (low + high) / 2
        ax.set_ylim(middle - span / 2, middle + span / 2)


def shade(k: int, j: int, count: int) -> tuple[float, float, float]:
    """Colour of block j of count in bucket k: the bucket's colour, mixed with white the more the later the block."""
    base = np.array(matplotlib.colors.to_rgb(f"C{k % 10}"))
    mix = MAX_SHADE * j / max(count - 1, 1)
    return tuple(base + (1 - base) * mix)


def _noise_level_panels(halves, fit, data: dict, row: dict, learned: bool) -> None:
    """Eq. 21's two halves against sigma, and u(sigma) beside ln(lambda L), for one snapshot's row; for a run that
    did not learn u, its loss lambda L (Eq. 14) against sigma, and no u."""
    sigma, error = (np.asarray(v, dtype=np.float64) for v in (data["sigma"], row["weighted_error"]))
    snapshot = f"EMA σ_rel={data['ema_std']:.3f} at kimg {row['kimg']:.1f}"
    if not learned:
        halves.plot(sigma, error, "o-", color="C1", markersize=3, label="λ(σ) L(σ): the loss at σ")
        halves.set_title(f"Eq. 14 per noise level, {snapshot}", fontsize=9, y=TITLE_Y)
        fit.text(0.5, 0.5, "no u(σ): trained with the uncertainty off", ha="center", va="center",
                 transform=fit.transAxes)
        fit.set_axis_off()
    else:
        u = np.asarray(row["u"], dtype=np.float64)
        scaled = error / np.exp(u)
        halves.plot(sigma, scaled, "o-", color="C1", markersize=3, label="λ(σ) L(σ) / exp u(σ)")
        halves.plot(sigma, u, "s-", color="C2", markersize=3, label="u(σ)")
        halves.plot(sigma, scaled + u, "--", color="0.4", linewidth=1, label="sum: the loss at σ")
        fit.plot(sigma, np.log(error), "o-", color="C3", markersize=3, label="ln λ(σ) L(σ), measured")
        fit.plot(sigma, u, "s-", color="C2", markersize=3, label="u(σ), learned")
        halves.set_title(f"Eq. 21 per noise level, {snapshot}", fontsize=9, y=TITLE_Y)
        fit.set_title(f"optimum of Eq. 21: u = ln λL, {snapshot}", fontsize=9, y=TITLE_Y)
    low, high = math.exp(data["P_mean"] - data["P_std"]), math.exp(data["P_mean"] + data["P_std"])
    for ax in (halves, fit) if learned else (halves,):
        ax.axvspan(low, high, color="0.9", zorder=0, label="training σ, ±1 std")
        ax.set(xscale="log", xlabel="σ")
        ax.xaxis.set_major_formatter(PLAIN)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def magnitudes_figure(data: dict) -> matplotlib.figure.Figure:
    """RMS of each block's output and each layer's raw weight against kimg, coloured by the paper's buckets, the
    blocks of one bucket in lighter and lighter shades of its colour.

    The y axes start at 0, so magnitudes that stay at unit scale read as flat lines and a drift stands out.
    """
    figure = plots.new_figure(11, 4.5, layout=None)  # drawn at the end of every run: fixed margins save time
    figure.subplots_adjust(left=0.06, right=0.98, top=0.92, bottom=0.11, wspace=0.18)
    rows = data["rows"]
    kimg = [row["kimg"] for row in rows]
    panels = (("activations", "block outputs (activations)"), ("weights", "layer weights (raw)"))
    buckets = list(dict.fromkeys(bucket(name) for key, _ in panels for name in (rows[-1][key] if rows else {})))
    for index, (key, title) in enumerate(panels):
        ax = figure.add_subplot(1, 2, index + 1)
        names = list(rows[-1][key]) if rows else []
        top = 1.0
        members = {group: [n for n in names if bucket(n) == group] for group in dict.fromkeys(map(bucket, names))}
        for name in names:
            k, group = buckets.index(bucket(name)), members[bucket(name)]
            values = [row[key].get(name, math.nan) for row in rows]
            top = max([top, *(v for v in values if math.isfinite(v))])
            ax.plot(kimg, values, marker="o", markersize=2, linewidth=1, color=shade(k, group.index(name), len(group)),
                    linestyle="-" if k < 10 else "--")
        for group in dict.fromkeys(bucket(name) for name in names):
            k = buckets.index(group)
            ax.plot([], [], color=f"C{k % 10}", linestyle="-" if k < 10 else "--", label=group)
        ax.set(xlabel="kimg", ylabel="RMS")
        ax.set_title(f"{title}, EMA σ_rel={data['ema_std']:.3f}", y=TITLE_Y)
        ax.set_ylim(0, 1.15 * top)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="lower left")
    return figure


def consistency_figure(rows: list[dict]) -> matplotlib.figure.Figure:
    """A consistency model's training (train_edm2.py --method=sct|scd) from its stats rows ({kimg, g_norm,
    grad_norm, logvar_t: {t: u}}): the tangent's norm ||g|| before normalization and the gradient norm against kimg,
    where sCM's blow-ups show first, and the adaptive weight's u(t) per t-bin, one curve per row, older ones lighter."""
    figure = plots.new_figure(11, 3.2, layout=None)
    axes = figure.subplots(1, 3)
    figure.subplots_adjust(left=0.06, right=0.98, top=0.88, bottom=0.16, wspace=0.3)
    kimg = [row["kimg"] for row in rows]
    for ax, key, title in ((axes[0], "g_norm", "tangent ||g|| (RMS, before normalization)"),
                           (axes[1], "grad_norm", "gradient norm")):
        ax.plot(kimg, [row[key] for row in rows], color="C0", linewidth=1)
        ax.set(xlabel="kimg", yscale="log")
        ax.yaxis.set_major_formatter(PLAIN)
        ax.set_title(title, y=TITLE_Y)
        ax.grid(alpha=0.3)
    ax = axes[2]
    for index, row in enumerate(rows):
        points = sorted((float(t), u) for t, u in row["logvar_t"].items())
        shade = 1 - (index + 1) / len(rows)
        ax.plot([t for t, _ in points], [u for _, u in points], "o-", markersize=2, linewidth=1,
                color=matplotlib.colors.to_rgb("C1") if shade == 0 else str(0.4 + 0.5 * shade),
                label=f"kimg {row['kimg']:g}" if index == len(rows) - 1 else None)
    ax.set(xlabel="t (TrigFlow)", ylabel="u(t)")
    ax.set_title("adaptive weight u(t) per t-bin", y=TITLE_Y)
    if rows:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return figure
