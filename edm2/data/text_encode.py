"""Caching a dataset's caption embeddings: the resumable, multi-process encode-text into a copy of the dataset with
NNNNN/txtIIIIIIII.npy beside each image (edm2.data.text_data reads them).

As the VAE encode (edm2.data.vae_datasets), progress is kept in DEST.partial/: the manifest, the finished .npy
files and one blocks/KKKKKKKK.json per finished block of `batch` captions (written after its .npy files, with their
lengths and how many were truncated). Blocks are fixed, so the result is the same whatever the interruptions or the
number of processes.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from edm2.data.dataset import DatasetError, ImageFolderDataset
from edm2.data.dataset_files import FileTree
from edm2.data.dataset_json import LABELS_FILE, read_record
from edm2.data.dataset_writer import is_zip_path, npy_bytes, write_failure, write_zip_member
from edm2.data.text_data import TEXT_EMPTY_FILE, text_fname
from edm2.data.vae_datasets import ENCODE_MANIFEST, EncodeWorkError, block_batches, start_work, work_dir
from edm2.runtime import bounded_json, distributed, files
from edm2.text_encoders import TextEncoder, stored_embeddings

BLOCKS = "blocks"
_BLOCK_GLOB = f"{BLOCKS}/*.json"


def block_file(work: Path, block: int) -> Path:
    """The file that marks block `block` finished and holds its captions' lengths."""
    return work / BLOCKS / f"{block:08d}.json"


def pending_text_blocks(work: Path, count: int, batch: int) -> list[int]:
    """Blocks of `batch` captions not finished yet."""
    return [k for k in range(len(block_batches(count, batch))) if not block_file(work, k).exists()]


def _write(path: Path, data: bytes) -> None:
    try:
        with files.atomic_path(path) as tmp:
            tmp.write_bytes(data)
    except OSError as e:
        raise write_failure(path, e) from None


def encode_block(work: Path, dataset: ImageFolderDataset, encoder: TextEncoder, block: int, indices: list[int]) -> None:
    """Encode one block's captions into its .npy files, then mark it finished with their lengths."""
    captions = [dataset.get_caption(i) for i in indices]
    pooled, tokens, lengths = encoder.encode(captions)
    for idx, embeddings in zip(indices, stored_embeddings(pooled, tokens)):
        _write(work / text_fname(dataset.fnames[idx]), npy_bytes(embeddings))
    truncated = int((encoder.token_counts(captions) > encoder.tokens).sum())
    _write(block_file(work, block), json.dumps({"lengths": lengths.tolist(), "truncated": truncated}).encode())


def read_blocks(work: Path, count: int, batch: int) -> tuple[list[int], int]:
    """(every caption's length, how many were truncated) from the finished blocks."""
    lengths, truncated = [], 0
    for k, indices in enumerate(block_batches(count, batch)):
        try:
            done = bounded_json.read(block_file(work, k))
            block_lengths, block_truncated = list(done["lengths"]), int(done["truncated"])
        except (OSError, bounded_json.JSONFileError, KeyError, TypeError, ValueError) as e:
            raise EncodeWorkError(f"{block_file(work, k)}: unreadable ({e}); delete {work} and rerun") from None
        if len(block_lengths) != len(indices):
            raise EncodeWorkError(f"{block_file(work, k)}: holds {len(block_lengths)} lengths, not {len(indices)}; "
                                  f"delete {work} and rerun")
        lengths += block_lengths
        truncated += block_truncated
    return lengths, truncated


def text_dataset_json(source_record: dict, dataset: ImageFolderDataset, encoder: TextEncoder, lengths: list[int],
                      empty_length: int) -> str:
    """The destination's dataset.json: the source's (labels, classes, encoding, captions) with the text records."""
    names = dataset.fnames
    return json.dumps({**source_record, "captions": [[name, dataset.get_caption(i)] for i, name in enumerate(names)],
                       "text_encoding": encoder.record(), "text_lengths": [list(e) for e in zip(names, lengths)],
                       "text_empty_length": empty_length})


def finish_text_encode(work: Path, source: Path, dest: Path, dataset: ImageFolderDataset, encoder: TextEncoder,
                       batch: int) -> int:
    """Add the empty caption's embeddings, the source's images and dataset.json to a complete progress folder and
    turn it into dest (ZIP or directory); returns how many captions were truncated."""
    count = len(dataset)
    lengths, truncated = read_blocks(work, count, batch)
    pooled, tokens, empty_length = encoder.encode([""])
    empty = npy_bytes(stored_embeddings(pooled, tokens)[0])
    source_files = FileTree(source)
    record = text_dataset_json(read_record(source_files), dataset, encoder, lengths, int(empty_length[0]))
    copied = [(name, text_fname(name)) for name in dataset.fnames]

    def read(tree: FileTree | Path, name: str) -> bytes:
        try:
            if isinstance(tree, FileTree):
                return tree.read(name)
            with files.open_input(tree / name) as f:  # a FIFO or device is refused, not waited on
                return f.read()
        except OSError as e:
            raise DatasetError(f"{tree}: cannot read {name} ({e.strerror or e})") from None

    if is_zip_path(dest):
        with files.atomic_path(dest) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as archive:
            try:
                for image, text in tqdm(copied, desc="write ZIP", unit="img"):
                    write_zip_member(archive, image, read(source_files, image))
                    write_zip_member(archive, text, read(work, text))
                write_zip_member(archive, TEXT_EMPTY_FILE, empty)
                write_zip_member(archive, LABELS_FILE, record)
            except OSError as e:
                raise write_failure(dest, e) from None
        shutil.rmtree(work)
        return truncated
    for image, _ in tqdm(copied, desc="copy images", unit="img"):
        _write(work / image, read(source_files, image))
    _write(work / TEXT_EMPTY_FILE, empty)
    files.remove_stale_temporaries(work, owned=True, recursive=True)  # every writer has finished
    _write(work / LABELS_FILE, record.encode())
    shutil.rmtree(work / BLOCKS)
    (work / ENCODE_MANIFEST).unlink()
    os.replace(work, dest)
    return truncated


def encode_text_dataset(dataset: ImageFolderDataset, source: Path, dest: Path, encoder: TextEncoder, batch: int,
                        report: Callable[[str], None] = distributed.print0) -> int:
    """Encode every caption of dataset into dest on every rank; rank 0 prepares and assembles and returns how many
    captions were truncated to the encoder's token length (the other ranks return 0)."""
    work = work_dir(dest)
    count = len(dataset)
    manifest = {"source": str(Path(source).resolve()), "images": count, "text_encoder": encoder.identity,
                "tokens": encoder.tokens, "batch": batch}
    pending = start_work(work, manifest, lambda: pending_text_blocks(work, count, batch), _BLOCK_GLOB)
    mine = pending[distributed.get_rank()::distributed.get_world_size()]
    done = count - sum(map(len, block_batches(count, batch, pending)))
    if distributed.is_main() and done:
        report(f"resuming from {work}: {done} of {count} captions already encoded")
    with tqdm(total=sum(map(len, block_batches(count, batch, mine))), desc="encode-text", unit="caption",
              disable=not distributed.is_main()) as bar:
        for block, indices in zip(mine, block_batches(count, batch, mine)):
            encode_block(work, dataset, encoder, block, indices)
            bar.update(len(indices))
    distributed.barrier()
    if not distributed.is_main():
        return 0
    missing = pending_text_blocks(work, count, batch)
    if missing:
        raise EncodeWorkError(f"{work}: captions of {len(missing)} batches are missing; rerun to finish")
    return finish_text_encode(work, source, dest, dataset, encoder, batch)
