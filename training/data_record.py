"""What identifies a run's data, as its training states record it: each source's kind, count, identity and share of
an epoch, so that a run resumed on other data is told what changed instead of reading another dataset's order.

A shard dataset is identified by its index's id (a hash of the index's fields and of what its samples came from),
a ZIP by its members' names, CRC-32s and sizes (its central directory: no image is read), a folder by its images'
names and sizes, and either by the labels it trains with; a blend by each of its datasets and their shares.
"""

from __future__ import annotations

import hashlib
import os
import zipfile

import numpy as np

from edm2.data.blend import BlendDataset
from edm2.data.dataset import ImageData, ImageFolderDataset
from edm2.data.shards import ShardDataset
from edm2.errors import EDM2Error

class DataChanged(EDM2Error):
    """A run resumed on data other than its training state records, without --allow-data-change."""


# The entries of one source's record, and the type of each.
SOURCE_KEYS = {"name": str, "kind": str, "count": int, "identity": str, "share": int}


def data_record(dataset: ImageData) -> dict:
    """The record of the data a run reads: {"sources": [{name, kind, count, identity, share}, ...]}, a blend's
    datasets in order (share: its samples of each blend epoch), else the one dataset (share: all of it)."""
    if isinstance(dataset, BlendDataset):
        parts = list(zip(dataset.sources, dataset.names, dataset.segments))
    else:
        parts = [(dataset, str(dataset.path), len(dataset))]
    return {"sources": [dict(name=name, **_identity(source), count=len(source), share=share)
                        for source, name, share in parts]}


def _identity(dataset: ShardDataset | ImageFolderDataset) -> dict:
    """The kind of a dataset and what identifies its contents."""
    if isinstance(dataset, ShardDataset):
        return dict(kind="shards", identity=dataset.index["id"])
    digest = hashlib.sha256()
    if dataset.path.is_file():
        with zipfile.ZipFile(dataset.path) as archive:
            members = sorted((info.filename, info.CRC, info.file_size) for info in archive.infolist())
        kind, parts = "zip", members
    else:
        kind, parts = "folder", [(name, os.stat(dataset.path / name).st_size) for name in dataset.fnames]
    for part in parts:
        digest.update(repr(part).encode())
    if dataset.raw_labels is not None:
        digest.update(np.asarray(dataset.raw_labels, dtype=np.int64).tobytes())
    return dict(kind=kind, identity=digest.hexdigest())


def is_record(value: object) -> bool:
    """Whether value has the form data_record gives (as read back from a training state)."""
    return isinstance(value, dict) and set(value) == {"sources"} and isinstance(value["sources"], list) and all(
        isinstance(source, dict) and set(source) == set(SOURCE_KEYS)
        and all(type(source[key]) is kind for key, kind in SOURCE_KEYS.items()) for source in value["sources"])


def data_change(recorded: dict, current: dict) -> str | None:
    """What differs between a recorded data record and the current one, as one phrase (the first difference), or
    None when they identify the same data; names (paths) alone may differ: moved data is the same data."""
    before, now = recorded["sources"], current["sources"]
    if len(before) != len(now):
        return f"the data is {len(now)} dataset(s), the state's was {len(before)}"
    epoch_before, epoch_now = sum(s["share"] for s in before), sum(s["share"] for s in now)
    for was, source in zip(before, now):
        name = source["name"]
        if source["count"] != was["count"]:
            return f"{name} holds {source['count']} samples, the state's {was['name']} held {was['count']}"
        if (source["kind"], source["identity"]) != (was["kind"], was["identity"]):
            return (f"{name} ({source['kind']}) holds other samples than the state's {was['name']} ({was['kind']}) "
                    f"did, of the same count")
        if (source["share"], epoch_now) != (was["share"], epoch_before):
            return (f"{name}'s share is {source['share']} of every {epoch_now} samples, the state's was "
                    f"{was['share']} of every {epoch_before}")
    return None
