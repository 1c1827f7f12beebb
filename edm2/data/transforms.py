"""Crop and resize of HWC (or HW grayscale) uint8 images for dataset preparation (release transforms; ADM's for
ImageNet)."""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import PIL.Image

from edm2.errors import EDM2Error

TRANSFORMS = ("center-crop", "center-crop-wide", "center-crop-dhariwal")


class TransformError(EDM2Error):
    """A crop/resize mode and an output size that do not go together."""


def unchanged(image: np.ndarray) -> np.ndarray:
    """No crop or resize."""
    return image


def make_transform(transform: str | None, size: tuple[int, int] | None) -> Callable[[np.ndarray], np.ndarray]:
    """The image -> image function of a mode (TRANSFORMS, None = resize only) and an output (width, height).

    Without a size, images stay as they are; datasets hold square images, so only center-crop-wide (which
    pads to a square) takes a width different from the height.
    """
    if size is None:
        if transform is not None:
            raise TransformError(f"{transform} needs an output size")
        return unchanged
    width, height = size
    if transform not in (None, *TRANSFORMS):
        raise TransformError(f"unknown transform {transform!r}; choose one of {', '.join(TRANSFORMS)}")
    if transform == "center-crop-wide":
        if height > width:
            raise TransformError(f"center-crop-wide needs width >= height, got {width}x{height}")
        return functools.partial(center_crop_wide, width=width, height=height)
    if width != height:
        raise TransformError(f"{transform or 'resizing'} needs a square resolution (datasets hold square "
                             f"images), got {width}x{height}")
    if transform == "center-crop-dhariwal":
        return functools.partial(center_crop_dhariwal, size=width)
    if transform == "center-crop":
        return functools.partial(center_crop, width=width, height=height)
    return functools.partial(resize, width=width, height=height)


def resize(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """Resize a HWC uint8 image with LANCZOS; unchanged when it already has that size."""
    if image.shape[1] == width and image.shape[0] == height:
        return image
    return np.asarray(PIL.Image.fromarray(image).resize((width, height), PIL.Image.Resampling.LANCZOS))


def center_crop(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """Crop the centred square of the shorter side, then resize it to width x height."""
    h, w = image.shape[:2]
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    return resize(image[top:top + side, left:left + side], width, height)


def center_crop_wide(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """Crop the largest centred width:height region, resize it, and centre it on a black square canvas."""
    h, w = image.shape[:2]
    if w * height <= h * width:
        crop_w, crop_h = w, max(1, round(w * height / width))
    else:
        crop_w, crop_h = max(1, round(h * width / height)), h
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    canvas = np.zeros((width, width, *image.shape[2:]), dtype=np.uint8)  # HW grayscale or HWC
    row = (width - height) // 2
    canvas[row:row + height] = resize(image[top:top + crop_h, left:left + crop_w], width, height)
    return canvas


def center_crop_dhariwal(image: np.ndarray, size: int) -> np.ndarray:
    """ADM's ImageNet preprocessing (paper App. D.3; ADM's image_datasets.py): BOX-halve, BICUBIC-resize, centre-crop."""
    pil = PIL.Image.fromarray(image)
    while min(pil.size) >= 2 * size:
        pil = pil.resize((pil.width // 2, pil.height // 2), PIL.Image.Resampling.BOX)
    scale = size / min(pil.size)
    pil = pil.resize((round(pil.width * scale), round(pil.height * scale)), PIL.Image.Resampling.BICUBIC)
    array = np.asarray(pil)
    top, left = (array.shape[0] - size) // 2, (array.shape[1] - size) // 2
    return array[top:top + size, left:left + size]
