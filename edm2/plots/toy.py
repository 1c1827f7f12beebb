"""The autoguidance paper's Figure 1 for any pair of toy denoisers: ground truth, samples without and with guidance,
and a close-up of one branch tip with the models' densities, scores and sampling trajectories.

Top row, over the whole distribution: the ground truth (class A in orange over both classes in grey, with exact
samples of A), then samples of the main model without and with guidance. Then four close-ups of one branch of
class A at noise level 0.03 (the release's views): trajectories without guidance; the densities of the main
model (green), the guiding model (red) and their ratio (blue, the direction guidance pushes), each with its score
arrows at the starting points; and trajectories with guidance. Densities are drawn as in the release: filled
contours of -sqrt(max log p - log p).
"""

from __future__ import annotations

import dataclasses

import matplotlib.collections
import numpy as np
import torch

from edm2.plots import new_figure
from edm2.toy.gmm import GaussianMixture, ground_truth
from edm2.toy.model import ToyDenoiser, sample_trajectories

GT_ALL = dict(levels=[-2.12, 0], colors=[[0.9, 0.9, 0.9]], linecolors=[[0.7, 0.7, 0.7]], linewidth=0.75)
GT_CLASS = dict(levels=[-2.12, 0], colors=[[1.0, 0.8, 0.6]], linecolors=[[0.8, 0.6, 0.5]], linewidth=0.75)
GT_NOISY = dict(levels=[-1.41, 0], colors=["C1"], alpha=0.2, linealpha=0.2)
GT_SHADED = dict(levels=np.linspace(-2.5, 3.07, 15)[1:-1], cmap="Oranges", linealpha=0.2)


@dataclasses.dataclass(frozen=True)
class View:
    """A square region of the plane, the grid its densities are drawn on, and the samples drawn in it."""

    center: tuple[float, float]
    half_size: float
    resolution: int
    num_samples: int
    sigma_max: float  # sampling starts from the ground truth at this noise level
    min_distance: float = 0.0  # starting points closer than this to an earlier one are dropped

    def grid(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [R], y [R] and the points [R, R, 2] of the grid."""
        gx, gy = (torch.linspace(c - self.half_size, c + self.half_size, self.resolution, device=device)
                  for c in self.center)
        return gx, gy, torch.stack(torch.meshgrid(gx, gy, indexing="xy"), dim=-1)


# The release's two views; the grids and sample counts are smaller than its (400 points, 2^14 samples) so that
# a CPU draws the figure in seconds.
OVERVIEW = View(center=(0.30, 0.30), half_size=1.2, resolution=256, num_samples=1 << 13, sigma_max=5.0)
CLOSE_UP = View(center=(0.45, 1.22), half_size=0.3, resolution=160, num_samples=1 << 12, sigma_max=0.03,
                min_distance=0.045)
PROGRESS = View(center=(0.30, 0.30), half_size=1.2, resolution=160, num_samples=1 << 12, sigma_max=5.0)


class _Panel:
    """One subplot showing a view: contours of log densities on its grid, points, lines and arrows."""

    def __init__(self, axes, view: View, grid: tuple, title: str):
        self.axes, self.view, (self.gx, self.gy, _) = axes, view, grid
        (cx, cy), h = view.center, view.half_size
        axes.set_xlim(cx - h, cx + h)
        axes.set_ylim(cy - h, cy + h)
        axes.set_aspect("equal")
        axes.set_axis_off()
        axes.set_title(title, fontsize=16)

    def density(self, logp: torch.Tensor, levels, colors=None, cmap=None, alpha=1.0, linecolors="black",
                linealpha=1.0, linewidth=1.25) -> None:
        """Filled contours with outlines of -sqrt(max log p - log p) (0 at the peak, negative elsewhere)."""
        values = -(logp.max() - logp).sqrt().cpu().numpy()
        x, y = self.gx.cpu().numpy(), self.gy.cpu().numpy()
        self.axes.contourf(x, y, values, levels=levels, extend="max", colors=colors, cmap=cmap, alpha=alpha)
        self.axes.contour(x, y, values, levels=levels, colors=linecolors, alpha=linealpha, linestyles="solid",
                          linewidths=linewidth)

    def points(self, xy: torch.Tensor, size: float, alpha: float = 1.0) -> None:
        self.axes.plot(*xy.cpu().numpy().T, ".", color="black", markeredgecolor="none", alpha=alpha, markersize=size)

    def trajectories(self, paths: torch.Tensor) -> None:
        """Each point's path [steps, n, 2] as a line."""
        lines = matplotlib.collections.LineCollection(paths.transpose(0, 1).cpu().numpy(), colors="black",
                                                      alpha=0.3, linewidths=2.5, capstyle="butt")
        self.axes.add_collection(lines)

    def arrows(self, xy: torch.Tensor, direction: torch.Tensor, color: str) -> None:
        self.axes.quiver(*xy.cpu().numpy().T, *(direction * 0.002).cpu().numpy().T, scale=0.6, width=5e-3,
                         headwidth=4, headlength=3, headaxislength=2.5, color=color)


def starting_points(view: View, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """The view's starting points: class A at the view's noise level, thinned to the minimum distance in order."""
    points = ground_truth("A", device).sample(view.num_samples, view.sigma_max, generator=generator)
    if view.min_distance <= 0:
        return points
    kept = [points[0]]
    for point in points[1:]:
        if (torch.stack(kept) - point).square().sum(-1).min() >= view.min_distance**2:
            kept.append(point)
    return torch.stack(kept)


def _overview_row(figure_axes, net, gnet, guidance: float, device: torch.device, generator: torch.Generator) -> None:
    """The top row's three panels: ground truth, samples without guidance, samples with guidance."""
    view = OVERVIEW
    grid = view.grid(device)
    gt_all, gt_class = ground_truth("AB", device).logp(grid[2]), ground_truth("A", device).logp(grid[2])
    start = starting_points(view, generator, device)
    samples = {
        "Ground truth distribution": ground_truth("A", device).sample(view.num_samples, generator=generator),
        "Sample distribution without guidance": sample_trajectories(net, start, view.sigma_max)[-1],
        "Sample distribution with guidance": sample_trajectories(net, start, view.sigma_max, gnet, guidance)[-1],
    }
    for axes, (title, points) in zip(figure_axes, samples.items()):
        panel = _Panel(axes, view, grid, title)
        panel.density(gt_all, **GT_ALL)
        panel.density(gt_class, **GT_CLASS)
        panel.points(points, size=7, alpha=0.3)


def _close_up_panels(figure_axes, net, gnet, guidance: float, device: torch.device, generator: torch.Generator) -> None:
    """The close-ups: trajectories without guidance, the densities and scores of both models and their ratio,
    trajectories with guidance."""
    view = CLOSE_UP
    grid = view.grid(device)
    shaded, noisy = ground_truth("A", device).logp(grid[2]), ground_truth("A", device).logp(grid[2], view.sigma_max)
    start = starting_points(view, generator, device)
    sigma = torch.full(start.shape[:-1], view.sigma_max, device=device)
    with torch.no_grad():
        p_net, p_gnet = net.logp(grid[2], view.sigma_max), gnet.logp(grid[2], view.sigma_max)
    s_net, s_gnet = net.score(start, sigma), gnet.score(start, sigma)
    for axes, title, w in ((figure_axes[0], "Trajectories without guidance", 1.0),
                           (figure_axes[4], "Trajectories with guidance", guidance)):
        panel = _Panel(axes, view, grid, title)
        panel.density(shaded, **GT_SHADED)
        paths = sample_trajectories(net, start, view.sigma_max, gnet, w)
        panel.trajectories(paths)
        panel.points(paths[-1], size=15)
    densities = (("PDF of main model", p_net, np.linspace(-2.5, 2.5, 20), "Greens", s_net, "C2"),
                 ("PDF of guiding model", p_gnet, np.linspace(-2.5, 3.5, 20), "Reds", s_gnet, "C3"),
                 ("PDF ratio (main / guiding)", p_net - p_gnet, np.linspace(-2.2, 1.0, 20), "Blues", s_net - s_gnet,
                  "C0"))
    for axes, (title, logp, levels, cmap, score, color) in zip(figure_axes[1:4], densities):
        panel = _Panel(axes, view, grid, title)
        panel.density(logp, levels=levels[1:-1], cmap=cmap, linealpha=0.2)
        panel.density(noisy, **GT_NOISY)
        panel.arrows(start, score, color)
        panel.points(start, size=15)


def toy_figure(net: ToyDenoiser | GaussianMixture, gnet: ToyDenoiser, guidance: float,
               device: torch.device | str = "cpu", seed: int = 1):
    """The eight panels of Figure 1 for main network net, guiding network gnet and guidance weight w (Eq. 152)."""
    device = torch.device(device)
    generator = torch.Generator(device).manual_seed(seed)
    figure = new_figure(24, 12.5)
    figure.set_layout_engine("tight")
    axes = figure.subplots(2, 4).ravel()
    _overview_row(axes[:3], net, gnet, guidance, device, generator)
    _close_up_panels([axes[3], axes[4], axes[5], axes[6], axes[7]], net, gnet, guidance, device, generator)
    return figure


def progress_figure(net: ToyDenoiser, title: str, device: torch.device | str = "cpu", seed: int = 1):
    """One panel of a network's samples over the ground truth, as training goes (the release's live view)."""
    device = torch.device(device)
    start = starting_points(PROGRESS, torch.Generator(device).manual_seed(seed), device)
    return samples_figure({title: sample_trajectories(net, start, PROGRESS.sigma_max)[-1]}, device)


def samples_figure(samples: dict[str, torch.Tensor], device: torch.device | str = "cpu", classes: str = "A"):
    """One panel per entry, its points [n, 2] over the ground truth (the given classes in orange over both in grey),
    titled by its key: a network's samples as training goes, or a few-step model's samples."""
    device = torch.device(device)
    view = PROGRESS
    grid = view.grid(device)
    figure = new_figure(8 * len(samples), 8)
    gt_all, gt_class = ground_truth("AB", device).logp(grid[2]), ground_truth(classes, device).logp(grid[2])
    for axes, (title, points) in zip(np.atleast_1d(figure.subplots(1, len(samples))), samples.items()):
        panel = _Panel(axes, view, grid, title)
        panel.density(gt_all, **GT_ALL)
        panel.density(gt_class, **GT_CLASS)
        panel.points(points, size=7, alpha=0.25)
    return figure
