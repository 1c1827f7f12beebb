"""Figure 15 (edm2.plots.ladder): one row per run, four panels, one line per bucket, every line inside its axes."""

import math

import pytest

from edm2.plots.ladder import PANELS, figure15, growth


def records(weights: float, scale: float) -> list[dict]:
    """Three snapshots of two buckets: activations growing by `scale` per snapshot, weights within 1e-4 of
    `weights` (as forced weights' RMS is, eps and round-off apart)."""
    rows = []
    for i, kimg in enumerate((4, 8, 12)):
        buckets = ("enc 8x8", "dec 8x8")
        acts = {b: {"max": (k + 2) * scale**i, "mean": (k + 1) * scale**i} for k, b in enumerate(buckets)}
        w = weights * (1 + 1e-4 * (-1) ** i)
        rows.append(dict(kimg=kimg, activations=acts, weights={b: {"max": w, "mean": w} for b in buckets}))
    return rows


def test_every_panel_has_a_line_per_bucket_inside_its_axes():
    # E-G's weights are forced to RMS 1 exactly: their lines must lie inside the axes, not on the top frame.
    figure = figure15({"C": records(1.3, 1.2), "G": records(1.0, 1.0)})
    axes = figure.get_axes()
    assert len(axes) == 2 * len(PANELS)
    for ax in axes:
        lines = ax.get_lines()
        assert len(lines) == 2
        low, high = ax.get_ylim()
        top = max(max(line.get_ydata()) for line in lines)
        assert low == 0 and top < high and high == pytest.approx(1.1 * top)
    assert axes[6].get_title() == "G: weights (max)"


def test_growth_is_the_last_snapshot_over_the_first():
    rows = records(1.0, 1.2)
    got = growth(rows, "activations", "mean")
    assert got == {"enc 8x8": pytest.approx(1.44), "dec 8x8": pytest.approx(1.44)}
    assert all(math.isclose(v, 1.0, rel_tol=1e-6) for v in growth(rows, "weights", "max").values())
