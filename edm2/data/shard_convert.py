"""Filling shard datasets from a source of samples: a dataset (folder, ZIP or shards), images read as convert reads
them (ConvertedSamples) or webdataset tar shards, as they are (convert) or through the VAE (encode, over every
process of a torchrun). Resumable by shard (edm2/data/shard_writer.py); the result does not depend on interruptions
or the number of processes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from edm2.data import shard_writer
from edm2.data.convert import ConvertedSamples
from edm2.data.dataset_files import DatasetError
from edm2.data.shards import num_shards, shard_count
from edm2.data.tar_source import TarSource
from edm2.encoders import Encoder
from edm2.runtime import distributed


def source_labels(source: object) -> np.ndarray | None:
    """The class of every sample of a source (a TarSource, ConvertedSamples or a dataset), None when unlabeled."""
    if isinstance(source, (TarSource, ConvertedSamples)):
        return source.labels
    labels = source.raw_labels
    return None if labels is None else np.array([labels[i] for i in range(len(source))], dtype=np.int64)


def source_captions(source: object) -> list[str] | None:
    """The caption of every sample of a source (a TarSource, ConvertedSamples or a dataset), None when it has none."""
    if isinstance(source, (TarSource, ConvertedSamples)):
        return source.captions
    return [source.get_caption(i) for i in range(len(source))] if source.has_captions else None


def source_samples(source: object, first: int, n: int) -> np.ndarray:
    """Samples [first, first + n) of a source, NCHW as stored."""
    if isinstance(source, (TarSource, ConvertedSamples)):
        return source.pixels(first, n)
    return np.stack([source[i][0] for i in range(first, first + n)])


def source_index(source: object, encoding: dict, shape: list[int], identity: dict, count: int | None = None,
                 shard_size: int | None = None) -> dict:
    """The index of a shard dataset of a source's first `count` samples in an encoding (Encoder.dataset_record)."""
    count = min(len(source), count or len(source))
    labels = source_labels(source)
    label_dim = 0 if labels is None else int(labels[:count].max()) + 1
    return shard_writer.new_index(encoding["encoding"], shape, label_dim, count, identity, shard_size,
                                  encoding.get("encoding_settings"), getattr(source, "classes", None),
                                  captions=source_captions(source) is not None)


def convert_to_shards(source: object, dest: Path, index: dict, report: Callable[[str], None]) -> int:
    """Write a source's samples as they are into the shard dataset dest (resuming its progress folder)."""
    labels, captions = source_labels(source), source_captions(source)

    def fill(_k: int, first: int, n: int) -> tuple[np.ndarray, np.ndarray | None, list[str] | None]:
        return (source_samples(source, first, n), None if labels is None else labels[first:first + n],
                None if captions is None else captions[first:first + n])
    return shard_writer.write_shards(dest, index, fill, report)


def encode_to_shards(source: object, dest: Path, index: dict, encoder: Encoder, batch: int,
                     report: Callable[[str], None]) -> None:
    """Encode a source's pixels into the latent shard dataset dest on every rank; rank 0 prepares and finishes.

    Each shard is encoded in fixed blocks of `batch` from its first sample, so every image is encoded in the same
    company whatever the interruptions or the number of processes. In a single process, a refusal of the samples
    removes a progress folder this call made (as shard_writer.write_shards does)."""
    problem, pending = None, []
    created = not shard_writer.work_folder(dest).exists()
    if distributed.is_main():
        try:
            pending = shard_writer.prepare(dest, index)
        except shard_writer.ShardWorkError as e:
            problem = str(e)
    problem, pending = distributed.broadcast_object((problem, pending))
    if problem:
        raise shard_writer.ShardWorkError(problem)
    if distributed.is_main() and len(pending) < num_shards(index):
        report(f"resuming {shard_writer.work_folder(dest)}: {num_shards(index) - len(pending)} of "
               f"{num_shards(index)} shards already written")
    labels, captions, device = source_labels(source), source_captions(source), distributed.device()
    try:
        for k in pending[distributed.get_rank()::distributed.get_world_size()]:
            first, n = k * index["shard_size"], shard_count(index, k)
            latents = []
            for start in range(first, first + n, batch):
                pixels = torch.from_numpy(source_samples(source, start, min(batch, first + n - start)))
                latents.append(encoder.encode_pixels(pixels.to(device)).cpu().numpy())
            shard_writer.write_shard(dest, index, k, np.concatenate(latents).astype(np.float32),
                                     None if labels is None else labels[first:first + n],
                                     None if captions is None else captions[first:first + n])
    except DatasetError:
        if created and distributed.get_world_size() == 1:  # other ranks may still be writing into it
            shutil.rmtree(shard_writer.work_folder(dest))
        raise
    distributed.barrier()
    if distributed.is_main():
        shard_writer.finish(dest, index)
