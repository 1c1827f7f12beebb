"""Uint8 image batches of a dataset for feature statistics, split across ranks."""

from __future__ import annotations

import numpy as np
import torch
import torch.utils.data

from edm2.procedures.generation import GRID_FILE
from edm2.runtime import distributed


def sample_indices(fnames: list[str]) -> np.ndarray:
    """Indices of the files that are samples: all but a top-level grid.png."""
    return np.array([i for i, name in enumerate(fnames) if name != GRID_FILE], dtype=np.int64)


def _stack_images(items: list[tuple[np.ndarray, object]]) -> torch.Tensor:
    """Collate dataset items (image, label) into a uint8 NCHW batch, dropping the labels."""
    return torch.from_numpy(np.stack([image for image, _ in items]))


def image_batches(dataset: torch.utils.data.Dataset, indices: np.ndarray, batch_size: int, num_workers: int = 2,
                  device: torch.device | str = "cpu") -> torch.utils.data.DataLoader:
    """A loader over this rank's share of dataset[indices], yielding uint8 NCHW batches."""
    batches = distributed.rank_batches(indices, batch_size, distributed.get_rank(), distributed.get_world_size(),
                                       skip_empty=True)
    return torch.utils.data.DataLoader(dataset, batch_sampler=batches, num_workers=num_workers,
                                       collate_fn=_stack_images, pin_memory=torch.device(device).type == "cuda")
