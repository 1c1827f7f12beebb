"""Toy images: one bright shape per image on a dark background; the class is the shape."""

from __future__ import annotations

import colorsys
from typing import Callable

import numpy as np


def _abs_max(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return np.maximum(np.abs(u), np.abs(v))


# Masks over coordinates (u, v) scaled so the shape fits the unit square; v points down.
SHAPES: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "circle": lambda u, v: u * u + v * v <= 1,
    "square": lambda u, v: _abs_max(u, v) <= 0.8,
    "triangle": lambda u, v: (v <= 0.75) & (np.abs(u) <= 0.55 * (v + 1)),
    "cross": lambda u, v: (np.minimum(np.abs(u), np.abs(v)) <= 0.3) & (_abs_max(u, v) <= 1),
    "ring": lambda u, v: (u * u + v * v <= 1) & (u * u + v * v >= 0.55 ** 2),
    "diamond": lambda u, v: np.abs(u) + np.abs(v) <= 1,
    "x": lambda u, v: ((np.abs(u - v) <= 0.42) | (np.abs(u + v) <= 0.42)) & (_abs_max(u, v) <= 0.8),
    "bars": lambda u, v: (np.abs(u) <= 0.9) & (np.abs(np.abs(v) - 0.55) <= 0.25),
}
TOY_BACKGROUND = np.array([24, 24, 32], dtype=np.float64)
TOY_SUPERSAMPLING = 4


def toy_image(shape: str, resolution: int, rng: np.random.Generator) -> np.ndarray:
    """HWC uint8 image of one shape with random bright colour, size and position, anti-aliased."""
    radius = rng.uniform(0.26, 0.36) * resolution
    margin = 0.04 * resolution
    cx, cy = rng.uniform(margin + radius, resolution - margin - radius, size=2)
    colour = 255 * np.array(colorsys.hsv_to_rgb(rng.uniform(), rng.uniform(0.6, 1), rng.uniform(0.8, 1)))
    s = TOY_SUPERSAMPLING
    coords = (np.arange(resolution * s) + 0.5) / s
    mask = SHAPES[shape]((coords[None, :] - cx) / radius, (coords[:, None] - cy) / radius)
    coverage = mask.reshape(resolution, s, resolution, s).mean(axis=(1, 3))[:, :, None]
    return np.round(TOY_BACKGROUND * (1 - coverage) + colour * coverage).astype(np.uint8)
