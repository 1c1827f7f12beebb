"""Figure 15 (and Figure 3) for several runs: activation and weight magnitudes per resolution bucket over training,
max and mean aggregation, one row per configuration (edm2.eval.magnitudes.bucket_magnitudes)."""

from __future__ import annotations

import math

import matplotlib.figure

from edm2 import plots

PANELS = (("activations", "max"), ("activations", "mean"), ("weights", "max"), ("weights", "mean"))


def figure15(runs: dict[str, list[dict]]) -> matplotlib.figure.Figure:
    """One row per run name, four panels each: activations (max, mean) and weights (max, mean) against kimg, one
    line per bucket; runs maps a name to its records {'kimg', 'activations', 'weights'} in training order."""
    figure = plots.new_figure(16, 3.2 * len(runs))
    for row, (name, records) in enumerate(runs.items()):
        kimg = [r["kimg"] for r in records]
        for col, (kind, how) in enumerate(PANELS):
            ax = figure.add_subplot(len(runs), len(PANELS), row * len(PANELS) + col + 1)
            top = 0.0
            for k, group in enumerate(records[-1][kind]):
                values = [r[kind].get(group, {}).get(how, math.nan) for r in records]
                ax.plot(kimg, values, color=f"C{k % 10}", linestyle="-" if k < 10 else "--", linewidth=1.2,
                        label=group)
                top = max([top, *(v for v in values if math.isfinite(v))])
            ax.set(xlabel="kimg", title=f"{name}: {kind} ({how})")
            # From 0, with room above the largest value: the forced weights of E-G sit at exactly 1, which an axis
            # ending there would draw on its frame.
            ax.set_ylim(0, 1.1 * top if top > 0 else 1)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.legend(fontsize=6, ncol=2, loc="lower left")
    return figure


def growth(records: list[dict], kind: str, how: str) -> dict[str, float]:
    """Per bucket, the last record's magnitude over the first's."""
    first, last = records[0][kind], records[-1][kind]
    return {group: last[group][how] / first[group][how] for group in last if group in first}
