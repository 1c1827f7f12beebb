"""A dataset at a glance: the first images of each class tiled into one grid, one row per class, and its counts."""

from __future__ import annotations

import collections
from typing import Callable

import numpy as np
import torch

from edm2.data.dataset import ImageData
from edm2.data.vae_datasets import mean_pixels
from edm2.procedures.image_grid import GRID_GAP_VALUE, tile


def class_counts(dataset: ImageData) -> dict[int | None, int]:
    """{class: images} of every class that has images, in class order; {None: images} for unlabeled data."""
    if dataset.raw_labels is None:
        return {None: len(dataset)}
    counts = collections.Counter(int(dataset.raw_labels[i]) for i in range(len(dataset)))
    return dict(sorted(counts.items()))


def first_of_each_class(dataset: ImageData, counts: dict[int | None, int],
                        per_class: int) -> dict[int | None, list[int]]:
    """The indices of the first per_class images of each class of counts (class_counts), in one pass over the
    labels that stops once every class has them."""
    wanted = {c: min(per_class, n) for c, n in counts.items()}
    chosen: dict[int | None, list[int]] = {c: [] for c in counts}
    missing = sum(wanted.values())
    for i in range(len(dataset)):
        if not missing:
            break
        c = None if dataset.raw_labels is None else int(dataset.raw_labels[i])
        if len(chosen[c]) < wanted[c]:
            chosen[c].append(i)
            missing -= 1
    return chosen


def preview_grid(dataset: ImageData, chosen: dict[int | None, list[int]], per_class: int,
                 decode: Callable[[np.ndarray], np.ndarray], batch: int = 8) -> np.ndarray:
    """One HWC uint8 image: a row per class of chosen (first_of_each_class), per_class cells wide, each image the
    decoding (decode: stored NCHW samples -> uint8 NCHW pixels) of its stored sample; a class with fewer images
    leaves its last cells blank (image_grid.tile's gap value)."""
    order = [i for indices in chosen.values() for i in indices]
    pixels = {}
    for start in range(0, len(order), batch):
        block = order[start:start + batch]
        for i, image in zip(block, decode(np.stack([dataset[i][0] for i in block]))):
            pixels[i] = image.transpose(1, 2, 0)
    blank = np.full_like(next(iter(pixels.values())), GRID_GAP_VALUE)
    cells = [pixels[indices[k]] if k < len(indices) else blank for indices in chosen.values() for k in range(per_class)]
    return tile(np.stack(cells), per_class)


def stored_pixels(samples: np.ndarray) -> np.ndarray:
    """A pixel dataset's samples are its images (preview_grid's decode for them)."""
    return samples


def decoded_means(encoder, device: torch.device, samples: np.ndarray) -> np.ndarray:
    """Stored mean/std latents decoded on device as dataset_tool.py decode does (vae_datasets.mean_pixels), uint8 NCHW
    (preview_grid's decode for latents)."""
    return mean_pixels(encoder, torch.from_numpy(np.ascontiguousarray(samples)).to(device)).cpu().numpy()
