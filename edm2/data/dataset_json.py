"""dataset.json, the release's record of a dataset's labels, and what we add beside them: the class names and the
encoding (what the files hold)."""

from __future__ import annotations

import json
import os
import zipfile

from edm2.data.dataset_files import DatasetError, FileTree
from edm2.errors import shown
from edm2.runtime import bounded_json

MAX_CLASSES = 1 << 20  # 48x ImageNet-21k's classes; a one-hot label of 2**20 already takes 4 MiB per image
LABELS_FILE = "dataset.json"
CLASSES_KEY = "classes"  # dataset.json's {class name: class}, beside the release's "labels", which it leaves as is


def read_labels(files: FileTree, names: list[str]) -> list[int] | None:
    """The classes dataset.json gives `names`, in that order; None without dataset.json or with null labels."""
    return read_dataset_json(files, names)[0]


def read_dataset_json(files: FileTree, names: list[str]) -> tuple[list[int] | None, dict[str, int] | None]:
    """The classes dataset.json gives `names`, in that order, and its class names ({name: class}, CLASSES_KEY);
    each None where dataset.json has none.

    The one reader of dataset.json ({"labels": [[name, class], ...]} or {"labels": null}, the release's
    format, which dataset_tool.py convert extends with CLASSES_KEY): every name must be listed, with a class
    (is_class).
    """
    if LABELS_FILE not in files.names:
        return None, None
    try:
        text = files.read(LABELS_FILE, limit=bounded_json.MAX_BYTES)
    except (OSError, zipfile.BadZipFile) as e:
        raise DatasetError(f"{files.path}: cannot read {LABELS_FILE} ({e})") from None
    try:
        stored = bounded_json.parse(text, f"{files.path}: {LABELS_FILE}")
    except bounded_json.JSONFileError:
        stored = text  # parse_labels names what is wrong with it
    labels = parse_labels(stored, files.path)
    classes = parse_classes(stored, files.path)
    if labels is None:
        return None, classes
    missing = [name for name in names if name not in labels]
    if missing:
        raise DatasetError(f"{files.path}: {LABELS_FILE} has no label for {shown(missing[0])} "
                           f"({len(missing)} images unlabeled)")
    values = [labels[name] for name in names]
    wrong = [v for v in values if not is_class(v)]
    if wrong:
        raise DatasetError(f"{files.path}: {LABELS_FILE} labels must be non-negative integers below "
                           f"{MAX_CLASSES} (classes), found {json.dumps(wrong[0])}")
    return values, classes


def parse_classes(stored: object, path: str | os.PathLike) -> dict[str, int] | None:
    """The {class name: class} map of a parsed dataset.json (or --labels file), None when it has none; each name
    names one class and each class has one name."""
    classes = stored.get(CLASSES_KEY) if isinstance(stored, dict) else None
    if classes is None:
        return None
    if not isinstance(classes, dict) or not all(is_class(label) for label in classes.values()):
        raise DatasetError(f"{path}: {CLASSES_KEY} must map class names to classes (integers in [0, {MAX_CLASSES}))")
    if len(set(classes.values())) < len(classes):
        label = next(v for v in classes.values() if list(classes.values()).count(v) > 1)
        raise DatasetError(f"{path}: {CLASSES_KEY} gives class {label} two names")
    return classes


def read_record(files: FileTree) -> dict:
    """dataset.json as an object; {} without one or for JSON that is no object (read_dataset_json refuses it)."""
    if LABELS_FILE not in files.names:
        return {}
    try:
        record = bounded_json.parse(files.read(LABELS_FILE, limit=bounded_json.MAX_BYTES), LABELS_FILE)
    except (OSError, zipfile.BadZipFile, bounded_json.JSONFileError) as e:
        raise DatasetError(f"{files.path}: cannot read {LABELS_FILE} ({e})") from None
    return record if isinstance(record, dict) else {}


def read_encoding(files: FileTree) -> tuple[object, object]:
    """(encoding, encoding_settings) that dataset.json records (edm2.encoders.ENCODINGS names them); (None, {}) for
    a dataset written by the release or an earlier version, which records none."""
    record = read_record(files)
    return record.get("encoding"), record.get("encoding_settings", {})


def is_class(label: object) -> bool:
    """Whether a dataset.json label is a class: an integer in [0, MAX_CLASSES) (JSON's true and false are not)."""
    return isinstance(label, int) and not isinstance(label, bool) and 0 <= label < MAX_CLASSES


def parse_labels(text: bytes | dict, path: str | os.PathLike) -> dict[str, object] | None:
    """{name: label} of a dataset.json text (or its parsed object), None for null labels; the labels themselves
    are checked later."""
    source = f"{path}: {LABELS_FILE}"
    try:
        listed = (text if isinstance(text, dict) else bounded_json.parse(text, source))["labels"]
    except bounded_json.JSONFileError as e:  # malformed, too large, too deep, or a number out of bounds
        reason = str(e).removeprefix(f"{source}: ")
    except KeyError:
        reason = "no 'labels' key"
    except TypeError as e:  # JSON that is not an object
        reason = f"TypeError: {e}"
    else:
        reason = None
    if reason is not None:
        raise DatasetError(f"{path}: {LABELS_FILE} is not in the release format "
                           f'{{"labels": [[name, class], ...]}} ({reason})')
    if listed is None:
        return None
    if not isinstance(listed, list) or not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                                               for e in listed):
        raise DatasetError(f"{path}: {LABELS_FILE} is not in the release format "
                           f'{{"labels": [[name, class], ...]}} (labels is not a list of [name, class] pairs)')
    return {name: label for name, label in listed}
