"""Toy images: one bright shape per image on a dark background; the class is the shape. Captioned toy images say
the shape's colour, its name and its side ("a red circle on the left"), and measure_adherence reads colour and side
back from pixels, to measure how well generated images follow their prompts."""

from __future__ import annotations

import colorsys
import dataclasses
from typing import Callable

import numpy as np

from edm2.errors import EDM2Error, shown


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
# Colour names of the hue's sextants: colour k covers hues [60k - 30, 60k + 30) degrees (red [-30, 30), yellow
# [30, 90), ..., magenta [270, 330)).
COLOURS = ("red", "yellow", "green", "cyan", "blue", "magenta")
# Captioned images keep their hue within HUE_SPREAD degrees of their sextant's centre, their saturation and value
# high, and their centre CENTRE_GAP of the resolution away from the image's centre, so that colour and side can be
# measured from the pixels of any of them (measure_adherence), not only of most.
HUE_SPREAD = 20
CAPTIONED_SATURATION = (0.8, 1.0)
CAPTIONED_VALUE = (0.85, 1.0)
CENTRE_GAP = 0.06
BRIGHT = 128  # measure_adherence: a pixel is the shape's when its largest channel is at least this


class HoldOutError(EDM2Error):
    """A --hold-out list that names no colour or shape of the toy, or that leaves a shape no colour."""


@dataclasses.dataclass(frozen=True)
class ToyParams:
    """What a toy image shows: the shape, its radius and centre (pixels; y points down) and its colour (HSV, each
    in [0, 1]) in an image of resolution x resolution pixels."""

    shape: str
    resolution: int
    radius: float
    cx: float
    cy: float
    hsv: tuple[float, float, float]


def toy_params(shape: str, resolution: int, rng: np.random.Generator) -> ToyParams:
    """The uncaptioned toy's random bright colour, size and position of a shape."""
    radius = rng.uniform(0.26, 0.36) * resolution
    margin = 0.04 * resolution
    cx, cy = rng.uniform(margin + radius, resolution - margin - radius, size=2)
    hsv = (rng.uniform(), rng.uniform(0.6, 1), rng.uniform(0.8, 1))
    return ToyParams(shape, resolution, radius, float(cx), float(cy), hsv)


def captioned_params(shape: str, resolution: int, rng: np.random.Generator,
                     colours: tuple[str, ...] = COLOURS) -> ToyParams:
    """A captioned toy image's shape: one of `colours` (a random hue within HUE_SPREAD degrees of its sextant's
    centre, saturated and bright), on a random side, CENTRE_GAP away from the centre, of the uncaptioned toy's
    sizes."""
    radius = rng.uniform(0.26, 0.36) * resolution
    low, high = 0.04 * resolution + radius, 0.96 * resolution - radius
    gap = CENTRE_GAP * resolution
    cx = rng.uniform(low, resolution / 2 - gap) if rng.integers(2) == 0 else rng.uniform(resolution / 2 + gap, high)
    cy = rng.uniform(low, high)
    centre = COLOURS.index(colours[rng.integers(len(colours))]) * 60
    hue = ((centre + rng.uniform(-HUE_SPREAD, HUE_SPREAD)) % 360) / 360
    hsv = (hue, rng.uniform(*CAPTIONED_SATURATION), rng.uniform(*CAPTIONED_VALUE))
    return ToyParams(shape, resolution, radius, float(cx), float(cy), hsv)


def draw_toy(params: ToyParams) -> np.ndarray:
    """HWC uint8 image of the shape params describe, anti-aliased (TOY_SUPERSAMPLING^2 samples a pixel)."""
    resolution, s = params.resolution, TOY_SUPERSAMPLING
    colour = 255 * np.array(colorsys.hsv_to_rgb(*params.hsv))
    coords = (np.arange(resolution * s) + 0.5) / s
    mask = SHAPES[params.shape]((coords[None, :] - params.cx) / params.radius,
                                (coords[:, None] - params.cy) / params.radius)
    coverage = mask.reshape(resolution, s, resolution, s).mean(axis=(1, 3))[:, :, None]
    return np.round(TOY_BACKGROUND * (1 - coverage) + colour * coverage).astype(np.uint8)


def toy_image(shape: str, resolution: int, rng: np.random.Generator) -> np.ndarray:
    """HWC uint8 image of one shape with random bright colour, size and position, anti-aliased."""
    return draw_toy(toy_params(shape, resolution, rng))


def colour_name(hue: float) -> str:
    """The name of the sextant (COLOURS) a hue in turns ([0, 1), 0 = red) falls in."""
    return COLOURS[int((hue * 360 + 30) % 360 // 60)]


def side_of(x: float, width: float) -> str:
    """'left' for a horizontal position left of the image's centre, else 'right'."""
    return "left" if x < width / 2 else "right"


def caption(colour: str, shape: str, side: str) -> str:
    """The toy's caption of a colour name, a shape and a side: "a COLOUR SHAPE on the SIDE"."""
    return f"a {colour} {shape} on the {side}"


def caption_of(params: ToyParams) -> str:
    """The caption of a toy image (caption): colour_name of its hue, its shape, side_of its centre."""
    return caption(colour_name(params.hsv[0]), params.shape, side_of(params.cx, params.resolution))


def measure_adherence(image: np.ndarray) -> tuple[str | None, str | None]:
    """(colour name, side) an HWC uint8 RGB image shows: colour_name of the hue of its bright pixels' mean colour
    (largest channel at least BRIGHT), side_of their centroid; (None, None) when no pixel is bright."""
    pixels = np.asarray(image, dtype=np.float64)
    bright = pixels.max(axis=-1) >= BRIGHT
    if not bright.any():
        return None, None
    hue = colorsys.rgb_to_hsv(*(pixels[bright].mean(axis=0) / 255))[0]
    columns = np.broadcast_to(np.arange(pixels.shape[1]) + 0.5, bright.shape)
    return colour_name(hue), side_of(float(columns[bright].mean()), pixels.shape[1])


def parse_hold_out(text: str, shapes: list[str]) -> frozenset[tuple[str, str]]:
    """The (colour, shape) pairs of a hold-out list "COLOUR:SHAPE,COLOUR:SHAPE,..." (COLOURS, and the toy's
    shapes); HoldOutError for anything else, a pair given twice, or a shape left with no colour."""
    pairs: list[tuple[str, str]] = []
    for item in text.split(","):
        colour, _, shape = item.strip().partition(":")
        if colour not in COLOURS or shape not in shapes:
            raise HoldOutError(f"{shown(item.strip())} is no COLOUR:SHAPE pair (colours: {', '.join(COLOURS)}; "
                               f"shapes: {', '.join(shapes)})")
        if (colour, shape) in pairs:
            raise HoldOutError(f"{colour}:{shape} is given twice")
        pairs.append((colour, shape))
    for shape in shapes:
        if all((colour, shape) in pairs for colour in COLOURS):
            raise HoldOutError(f"every colour of {shape} is held out; hold out at most {len(COLOURS) - 1} of them")
    return frozenset(pairs)


def kept_colours(shape: str, held_out: frozenset[tuple[str, str]]) -> tuple[str, ...]:
    """The colours a shape is drawn in when the (colour, shape) pairs held_out are left out."""
    return tuple(colour for colour in COLOURS if (colour, shape) not in held_out)
