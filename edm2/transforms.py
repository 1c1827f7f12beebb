"""Crop and resize of HWC uint8 images for dataset preparation (release transforms; ADM's for ImageNet)."""

from __future__ import annotations

import numpy as np
import PIL.Image


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
    canvas = np.zeros((width, width, 3), dtype=np.uint8)
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
