"""Opening training or reference data by what the path is: a blend spec, a shard dataset, or a folder or ZIP."""

from __future__ import annotations

import os
from pathlib import Path

from edm2.data.blend import BlendDataset, blend_sources, is_blend
from edm2.data.dataset import ImageData, ImageFolderDataset
from edm2.data.shards import ShardDataset, is_shard_dataset


def open_data(spec: str | os.PathLike, use_labels: bool = True, blends: bool = True, **folder: object) -> ImageData:
    """The dataset at spec: a BlendDataset (unless not blends), a ShardDataset, or an ImageFolderDataset (given
    `folder`'s keywords). DatasetError (BlendError for a malformed blend) for anything that cannot be used."""
    spec = str(spec)
    if blends and is_blend(spec):
        pairs = blend_sources(spec)  # a blend's blends read through: datasets alone
        sources = [open_data(path, use_labels, blends=False, **folder) for path, _ in pairs]
        return BlendDataset(sources, [weight for _, weight in pairs], [path for path, _ in pairs])
    if is_shard_dataset(spec):
        return ShardDataset(spec, use_labels=use_labels)
    return ImageFolderDataset(Path(spec), use_labels=use_labels, **folder)
