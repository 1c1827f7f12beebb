"""The FID-CLIP curve (NeMo's report of text-to-image models): FID on the x-axis, CLIP score on the y-axis, one
point per guidance strength, each labelled with its strength."""

from __future__ import annotations

from typing import Sequence

import matplotlib.figure

from edm2 import plots


def fid_clip_figure(points: Sequence[dict]) -> matplotlib.figure.Figure:
    """The curve through points {guidance, fid, clip_score} in order of guidance, each labelled 'w=G'."""
    figure = plots.new_figure(6, 4.5)
    ax = figure.add_subplot()
    ordered = sorted(points, key=lambda point: point["guidance"])
    ax.plot([p["fid"] for p in ordered], [p["clip_score"] for p in ordered], "o-", markersize=4)
    for point in ordered:
        ax.annotate(f"w={point['guidance']:g}", (point["fid"], point["clip_score"]), textcoords="offset points",
                    xytext=(5, 5), fontsize=8)
    ax.set(xlabel="FID", ylabel="CLIP score (ViT-L/14)", title="FID against CLIP score over guidance")
    ax.grid(alpha=0.3)
    return figure
