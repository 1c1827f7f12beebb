"""Writing shard datasets (edm2/data/shards.py), resumably: the shards are written into DEST.partial/, each shard
whole or not at all (a temporary renamed when complete), so a rerun writes only the shards still missing and
nothing twice; the index is written last and the folder renamed onto DEST.

The dataset's id is a hash of what defines it (source, count, shape, encoder, ...), so a resumed write and an
uninterrupted one give identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from edm2.data.dataset_files import DatasetError
from edm2.data.dataset_json import CLASSES_KEY
from edm2.data.captions import CAPTIONS_KEY, check_caption
from edm2.data.shards import (FORMAT, INDEX_FILE, LABEL_DTYPE, VERSION, captions_name, check_index, check_shard,
                              has_captions, num_shards, read_captions, shard_count, shard_header, shard_name)
from edm2.encoders import ENCODINGS
from edm2.runtime import bounded_json, files

PROGRESS_FILE = "progress.json"
# Samples per shard: about 256 MiB of samples, at least one; a shard is also the unit of a resumed write.
SHARD_BYTES = 256 << 20


class ShardWorkError(DatasetError):
    """A progress folder that belongs to another write (other settings) or to none."""


def new_index(encoding: str, shape: list[int], label_dim: int, count: int, identity: dict,
              shard_size: int | None = None, settings: dict | None = None,
              classes: dict[str, int] | None = None, captions: bool = False) -> dict:
    """The index of a shard dataset of an encoding (an edm2.encoders.ENCODINGS name, and its settings if any),
    class names (CLASSES_KEY, if any) and whether its samples have captions; its id hashes the index's fields and
    identity (what the samples come from)."""
    dtype = ENCODINGS[encoding].stored_dtype
    per_sample = int(np.prod(shape)) * np.dtype(dtype).itemsize
    shard_size = min(count, shard_size or max(1, SHARD_BYTES // per_sample))
    index = dict(format=FORMAT, version=VERSION, encoding=encoding)
    if settings:
        index["encoding_settings"] = settings
    index.update(dtype=dtype, shape=list(shape), label_dim=label_dim, count=count, shard_size=shard_size)
    if classes and label_dim:
        index[CLASSES_KEY] = dict(classes)  # only when named: the ids of datasets without names stay as they were
    if captions:
        index[CAPTIONS_KEY] = True  # only when captioned, for the same reason
    ident = hashlib.sha256(json.dumps([index, identity], sort_keys=True).encode()).hexdigest()[:32]
    return dict(index, id=ident)


def work_folder(dest: str | os.PathLike) -> Path:
    """The progress folder of a shard write into dest."""
    dest = Path(dest)
    return dest.with_name(dest.name + ".partial")


def prepare(dest: Path, index: dict) -> list[int]:
    """Create dest's progress folder, or check that an existing one is this write's; the shards still missing."""
    work = work_folder(dest)
    progress = work / PROGRESS_FILE
    if work.exists():
        try:
            previous = bounded_json.read(progress)
        except (OSError, bounded_json.JSONFileError) as e:
            raise ShardWorkError(f"{work} exists but is not an unfinished shard write ({e}); delete it or choose "
                                 f"another destination") from None
        if previous != index:
            changed = [key for key in index if not isinstance(previous, dict) or previous.get(key) != index[key]]
            raise ShardWorkError(f"{work} holds an unfinished write with other settings ({', '.join(changed)}); "
                                 f"rerun with the same options and source, or delete it")
        files.remove_stale_temporaries(work)
    else:
        with files.atomic_path(progress) as tmp:
            tmp.write_text(json.dumps(index, indent=2))
    return [k for k in range(num_shards(index)) if not (work / shard_name(k)).exists()]


def write_shard(dest: Path, index: dict, k: int, samples: np.ndarray, labels: np.ndarray | None,
                captions: list[str] | None = None) -> None:
    """Write shard k of dest's progress folder from its samples (n x CHW), classes and captions (for a captioned
    index); mixed shapes or dtypes are refused. The captions file is written first: a shard file whole means its
    shard complete."""
    expected = (shard_count(index, k), *index["shape"])
    if samples.dtype != np.dtype(index["dtype"]) or samples.shape != expected:
        raise DatasetError(f"shard {k}: samples of shape {'x'.join(map(str, samples.shape[1:]))} and dtype "
                           f"{samples.dtype}, but the dataset's are {'x'.join(map(str, index['shape']))} and "
                           f"{index['dtype']}; mixed shapes or dtypes")
    if index["label_dim"] and (labels is None or len(labels) != expected[0]):
        raise DatasetError(f"shard {k}: labeled dataset, but {0 if labels is None else len(labels)} labels for "
                           f"{expected[0]} samples")
    if has_captions(index):
        if captions is None or len(captions) != expected[0]:
            raise DatasetError(f"shard {k}: captioned dataset, but {0 if captions is None else len(captions)} "
                               f"captions for {expected[0]} samples")
        text = json.dumps([check_caption(c, f"shard {k} caption {i}") for i, c in enumerate(captions)])
        path = work_folder(dest) / captions_name(k)
        try:
            with files.atomic_path(path) as tmp:
                tmp.write_text(text)
        except OSError as e:
            raise files.OutputError(f"{path}: cannot write ({e.strerror or e})") from None
    path = work_folder(dest) / shard_name(k)
    try:
        with files.atomic_path(path) as tmp, open(tmp, "wb") as f:
            f.write(shard_header(index, k))
            f.write(np.ascontiguousarray(samples).tobytes())
            if index["label_dim"]:
                f.write(np.asarray(labels, dtype=LABEL_DTYPE).tobytes())
    except OSError as e:
        raise files.OutputError(f"{path}: cannot write ({e.strerror or e})") from None


def finish(dest: Path, index: dict) -> None:
    """Check every shard of the progress folder, write the index and rename the folder onto dest."""
    work = work_folder(dest)
    check_index(index, work)
    for k in range(num_shards(index)):
        check_shard(work, index, k)
        if has_captions(index):
            read_captions(work, index, k)
    with files.atomic_path(work / INDEX_FILE) as tmp:
        tmp.write_text(json.dumps(index, indent=2))
    (work / PROGRESS_FILE).unlink()
    os.replace(work, dest)


def write_shards(dest: Path, index: dict, fill: Callable[[int, int, int], tuple],
                 report: Callable[[str], None] | None = None) -> int:
    """Write (or finish) a whole shard dataset in this process: fill(k, first, count) gives shard k's samples and
    labels, and its captions for a captioned index (write_shard's arguments). Returns how many shards were already
    there.

    A refusal of the samples (a DatasetError: mixed shapes, an unreadable image) removes a progress folder this call
    made: its samples would be refused again, so nothing of it could be resumed."""
    created = not work_folder(dest).exists()
    pending = prepare(dest, index)
    done = num_shards(index) - len(pending)
    if done and report:
        report(f"resuming {work_folder(dest)}: {done} of {num_shards(index)} shards already written")
    try:
        for k in pending:
            write_shard(dest, index, k, *fill(k, k * index["shard_size"], shard_count(index, k)))
    except DatasetError:
        if created:
            shutil.rmtree(work_folder(dest))
        raise
    finish(dest, index)
    return done
