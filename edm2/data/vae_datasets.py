"""Pixel datasets through the VAE: the resumable, multi-process encode into latent datasets, and the decode back.

An encode keeps its progress in DEST.partial/ (the manifest encode.json and one finished .npy per image),
so a rerun continues where a killed one stopped; batches are fixed blocks of the whole dataset, so the
result is bit-identical whatever the interruptions or the number of processes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from tqdm import tqdm

from edm2.data.captions import caption_or_none
from edm2.data.dataset import DatasetError, ImageFolderDataset, latent_fname
from edm2.data.dataset_json import LABELS_FILE
from edm2.data.dataset_writer import dataset_writer, is_zip_path, labels_json, npy_bytes, write_failure
from edm2.encoders import Encoder, StabilityVAEEncoder
from edm2.errors import one_line
from edm2.runtime import bounded_json, distributed, files

ENCODE_MANIFEST = "encode.json"
_LATENT_GLOB = "*/img-mean-std-*.npy"


class EncodeWorkError(DatasetError):
    """A progress folder that is not this encode's (other settings, or no encode at all), or is incomplete."""


class IndexedImages(torch.utils.data.Dataset):
    """(index, image) items, so that a batch knows which files it holds."""

    def __init__(self, dataset: ImageFolderDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> tuple[int, np.ndarray]:
        return idx, self.dataset[idx][0]


def batches_of(dataset: ImageFolderDataset, batches: list[list[int]], workers: int) -> torch.utils.data.DataLoader:
    """Load the given index batches, with worker processes reading files ahead."""
    return torch.utils.data.DataLoader(IndexedImages(dataset), batch_sampler=batches, num_workers=workers)


def label_of(dataset: ImageFolderDataset, idx: int) -> int | None:
    """Class index of item idx, None for unlabeled datasets."""
    return None if dataset.raw_labels is None else int(dataset.raw_labels[idx])


def block_batches(count: int, batch: int, blocks: list[int] | None = None) -> list[list[int]]:
    """Index lists of the fixed blocks [k * batch, (k + 1) * batch) of count images (all blocks by default)."""
    if blocks is None:
        blocks = list(range((count + batch - 1) // batch))
    return [list(range(k * batch, min((k + 1) * batch, count))) for k in blocks]


def work_dir(dest: str | os.PathLike) -> Path:
    """The progress folder of an encode into dest."""
    dest = Path(dest)
    return dest.with_name(dest.name + ".partial")


def _write_manifest(work: Path, manifest: dict) -> None:
    with files.atomic_path(work / ENCODE_MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=2))


def prepare_work_dir(work: Path, manifest: dict, progress: str = _LATENT_GLOB) -> None:
    """Create the progress folder of an encode, or check that an existing one belongs to this encode (one whose
    finished files, the glob progress, are none yet may start afresh)."""
    if not work.exists():
        _write_manifest(work, manifest)
        return
    try:
        previous = bounded_json.read(work / ENCODE_MANIFEST)
        changed = [f"{key} {previous.get(key)!r} -> {value!r}" for key, value in manifest.items()
                   if previous.get(key) != value]
    except (OSError, bounded_json.JSONFileError, AttributeError) as e:  # AttributeError: JSON that is not an object
        raise EncodeWorkError(f"{work} exists but is not an unfinished encode ({type(e).__name__}: {one_line(e)}); "
                              f"delete it or choose another destination") from None
    if changed and not any(work.glob(progress)):
        _write_manifest(work, manifest)  # nothing encoded yet: start afresh
    elif changed:
        raise EncodeWorkError(f"{work} holds an unfinished encode with other settings ({'; '.join(changed)}); "
                              f"rerun with the same options or delete it")


def pending_blocks(work: Path, count: int, batch: int) -> list[int]:
    """Blocks of `batch` images with at least one latent file still missing."""
    done = {path.relative_to(work).as_posix() for path in work.glob(_LATENT_GLOB)}
    return [k for k, indices in enumerate(block_batches(count, batch))
            if any(latent_fname(i) not in done for i in indices)]


def save_latents(work: Path, indices: list[int], latents: np.ndarray) -> None:
    """Store each image's mean/std latents as its own finished file (kept if already there)."""
    for idx, latent in zip(indices, latents):
        path = work / latent_fname(idx)
        if not path.exists():
            try:
                with files.atomic_path(path) as tmp:
                    tmp.write_bytes(npy_bytes(latent))
            except OSError as e:
                raise write_failure(path, e) from None


def finish_encode(work: Path, dest: Path, dataset: ImageFolderDataset, count: int, encoding: dict) -> None:
    """Turn a complete progress folder into the output dataset (ZIP or directory) with dataset.json, recording the
    encoding (Encoder.dataset_record)."""
    names = [latent_fname(i) for i in range(count)]
    if is_zip_path(dest):
        with dataset_writer(dest) as writer:
            writer.encoding = encoding
            for idx, name in enumerate(tqdm(names, desc="write ZIP", unit="img")):
                try:
                    with files.open_input(work / name) as f:  # a FIFO or device is refused, not waited on
                        latents = f.read()
                except OSError as e:
                    raise DatasetError(f"{work}: cannot read {name} ({e.strerror or e})") from None
                writer.add(name, latents, label_of(dataset, idx), caption_or_none(dataset, idx))
        shutil.rmtree(work)
        return
    files.remove_stale_temporaries(work, owned=True, recursive=True)  # every writer has finished
    (work / ENCODE_MANIFEST).unlink()
    with files.atomic_path(work / LABELS_FILE) as tmp:
        tmp.write_text(labels_json({name: label_of(dataset, idx) for idx, name in enumerate(names)},
                               encoding=encoding,
                               captions={name: caption_or_none(dataset, idx) for idx, name in enumerate(names)}))
    os.replace(work, dest)


def start_work(work: Path, manifest: dict, pending: Callable[[], list[int]], progress: str = _LATENT_GLOB) -> list[int]:
    """On every rank, the blocks still to encode (pending(), asked on rank 0 once it has prepared the progress
    folder work for manifest, progress its finished files: prepare_work_dir); EncodeWorkError on every rank for a
    folder that is not this encode's."""
    problem, blocks = None, []
    if distributed.is_main():
        try:
            prepare_work_dir(work, manifest, progress)
            files.remove_stale_temporaries(work, recursive=True)
            blocks = pending()
        except EncodeWorkError as e:
            problem = str(e)
    problem, blocks = distributed.broadcast_object((problem, blocks))
    if problem:
        raise EncodeWorkError(problem)
    return blocks


def encode_dataset(dataset: ImageFolderDataset, dest: Path, encoder: Encoder, count: int, batch: int,
                   workers: int, manifest: dict, report: Callable[[str], None] = distributed.print0) -> None:
    """Encode the first count images of dataset into dest on every rank (encoder.encode_pixels); rank 0 prepares and
    assembles.

    manifest holds the settings a rerun must share to continue this encode's progress folder.
    """
    work = work_dir(dest)
    pending = start_work(work, manifest, lambda: pending_blocks(work, count, batch))
    # This rank's share of the pending blocks; every image is always encoded in the same company.
    batches = block_batches(count, batch, pending[distributed.get_rank()::distributed.get_world_size()])
    done = count - sum(map(len, block_batches(count, batch, pending)))
    if distributed.is_main() and done:
        report(f"resuming from {work}: {done} of {count} images already encoded")
    device = distributed.device()
    with tqdm(total=sum(map(len, batches)), desc="encode", unit="img", disable=not distributed.is_main()) as bar:
        for indices, images in batches_of(dataset, batches, workers):
            save_latents(work, indices.tolist(), encoder.encode_pixels(images.to(device)).cpu().numpy())
            bar.update(len(indices))
    distributed.barrier()
    if distributed.is_main():
        missing = pending_blocks(work, count, batch)
        if missing:
            raise EncodeWorkError(f"{work}: images of {len(missing)} batches are missing; rerun to finish")
        finish_encode(work, dest, dataset, count, encoder.dataset_record())


def mean_pixels(encoder: StabilityVAEEncoder, latents: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW pixels: the VAE decoding (encoder.decode_raw, StabilityVAEEncoder's or a subclass's) of stored
    mean/std latents' mean, the first half of their channels."""
    return encoder.decode_raw(latents[:, :latents.shape[1] // 2])


def decoded_images(dataset: ImageFolderDataset, encoder: StabilityVAEEncoder, count: int, batch: int,
                   device: torch.device) -> Iterator[tuple[int, np.ndarray]]:
    """(index, uint8 HWC image) of the VAE decoding of the mean of each of the first count stored latents."""
    for indices, latents in batches_of(dataset, block_batches(count, batch), 0):
        pixels = mean_pixels(encoder, latents.to(device))
        yield from zip(indices.tolist(), pixels.permute(0, 2, 3, 1).cpu().numpy())
