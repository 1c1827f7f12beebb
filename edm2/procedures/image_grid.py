"""Writing generated images: one HWC uint8 image as a PNG, and images tiled into one grid image."""

from __future__ import annotations

import os

import numpy as np
import PIL.Image

from edm2.runtime import files

# A one-pixel gap of this value between the images of a grid, and in the empty cells of its last row.
GRID_GAP_VALUE = 255


def save_png(path: str | os.PathLike, image: np.ndarray) -> None:
    """Write one HWC uint8 image as PNG through a temporary file (one channel as grayscale)."""
    pil = PIL.Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image)
    with files.atomic_path(path) as tmp:  # a full disk's error names the image
        pil.save(tmp, format="PNG")


def tile(images: np.ndarray, cols: int) -> np.ndarray:
    """NHWC uint8 images as one HWC image, row by row, `cols` per row, one pixel of GRID_GAP_VALUE between them."""
    n, h, w, c = images.shape
    rows = -(-n // cols)
    grid = np.full([rows * (h + 1) - 1, cols * (w + 1) - 1, c], GRID_GAP_VALUE, dtype=np.uint8)
    for i, image in enumerate(images):
        top, left = (i // cols) * (h + 1), (i % cols) * (w + 1)
        grid[top : top + h, left : left + w] = image
    return grid
