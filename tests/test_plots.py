"""The plotting package's shared parts: no display needed, PNGs written atomically."""

import matplotlib
import PIL.Image

from edm2 import plots


def test_figures_need_no_display_and_are_written_as_png(tmp_path):
    assert matplotlib.get_backend().lower() == "agg"
    figure = plots.new_figure(2, 1)
    figure.add_subplot().plot([0, 1], [1, 0])
    plots.save_png(figure, tmp_path / "sub" / "line.png", dpi=50)
    with PIL.Image.open(tmp_path / "sub" / "line.png") as image:
        assert image.format == "PNG" and image.size == (100, 50)
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["line.png"]  # no temporary left
