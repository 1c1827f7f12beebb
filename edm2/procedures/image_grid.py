"""Writing generated images: one HWC uint8 image as a PNG, and images tiled into one grid image."""

from __future__ import annotations

import os

import numpy as np
import PIL.Image
import PIL.ImageDraw
import PIL.ImageFont

from edm2.runtime import files

# A one-pixel gap of this value between the images of a grid, and in the empty cells of its last row.
GRID_GAP_VALUE = 255
LABEL_VALUE = 0  # the row labels' text, on the margin's GRID_GAP_VALUE
MAX_LABEL_PIXELS = 640  # the widest label margin: a longer label is cut there
LABEL_PADDING = 4  # pixels left and right of a label


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


def labelled_rows(rows: list[np.ndarray], labels: list[str]) -> np.ndarray:
    """Rows of NHWC uint8 images (one array per row, all of one image size) as one HWC grid, each row's label
    drawn in PIL's default font in a margin on the left (cut at MAX_LABEL_PIXELS); short rows end in empty cells."""
    h, w, c = rows[0].shape[1:]
    cols = max(len(row) for row in rows)
    blank = np.full([h, w, c], GRID_GAP_VALUE, dtype=np.uint8)
    cells = [image for row in rows for image in [*row, *[blank] * (cols - len(row))]]
    grid = tile(np.stack(cells), cols)
    font = PIL.ImageFont.load_default()
    width = min(MAX_LABEL_PIXELS, max(int(np.ceil(font.getlength(label))) for label in labels)) + 2 * LABEL_PADDING
    margin = np.full([grid.shape[0], width], GRID_GAP_VALUE, dtype=np.uint8)
    for i, label in enumerate(labels):
        band = PIL.Image.new("L", (width, h), GRID_GAP_VALUE)  # each label is cut at its own row's edges
        draw = PIL.ImageDraw.Draw(band)
        top, bottom = draw.textbbox((0, 0), label, font=font)[1::2]
        draw.text((LABEL_PADDING, (h - (bottom - top)) // 2 - top), label, fill=LABEL_VALUE, font=font)
        margin[i * (h + 1) : i * (h + 1) + h] = np.asarray(band)
    return np.concatenate([np.repeat(margin[:, :, None], c, axis=2), grid], axis=1)
