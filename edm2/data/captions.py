"""Captions of images: read from the conventions researchers use (a metadata.jsonl, NAME.txt beside NAME.png) and
from dataset.json's "captions" ([[name, text], ...], the form of its "labels"), each checked to be text of bounded
size.

A folder or ZIP of images has captions when it holds a metadata.jsonl (Hugging Face's imagefolder convention: one
JSON object a line, {"file_name": NAME, "text": CAPTION}, NAME relative to the folder of the metadata.jsonl) or a
NAME.txt (UTF-8) beside some image NAME.EXT. Then every image must have exactly one caption (possibly ""): an image
without one, or with one from both conventions, is refused, since which text was meant is unknowable.
"""

from __future__ import annotations

import os
import posixpath
import zipfile

from edm2.data.dataset_files import DatasetError, FileTree
from edm2.data.dataset_json import LABELS_FILE
from edm2.errors import one_line, shown
from edm2.runtime import bounded_json

MAX_CAPTION_BYTES = 64 << 10  # a caption is a sentence or a paragraph; 64 KiB of UTF-8 is far beyond any of them
METADATA_FILE = "metadata.jsonl"
CAPTIONS_KEY = "captions"  # dataset.json's [[name, caption], ...] and a shard index's true


class CaptionError(DatasetError):
    """A caption that is not text, too long, missing, given twice or naming no image; the message says which."""


def check_caption(value: object, where: str) -> str:
    """value when it is a caption: a string of at most MAX_CAPTION_BYTES bytes of UTF-8; CaptionError otherwise."""
    if not isinstance(value, str):
        raise CaptionError(f"{where}: the caption is a JSON {type(value).__name__}, not text")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate (JSON's "\ud800") is no text either
        raise CaptionError(f"{where}: the caption is not valid Unicode text") from None
    if size > MAX_CAPTION_BYTES:
        raise CaptionError(f"{where}: a caption of {size} bytes, more than the {MAX_CAPTION_BYTES} allowed")
    return value


def caption_text(data: bytes, where: str) -> str:
    """The caption a text file holds: UTF-8 (a byte-order mark allowed), without the whitespace around it."""
    if len(data) > MAX_CAPTION_BYTES:
        raise CaptionError(f"{where}: a caption of {len(data)} bytes, more than the {MAX_CAPTION_BYTES} allowed")
    try:
        return data.decode("utf-8-sig").strip()
    except UnicodeDecodeError as e:
        raise CaptionError(f"{where}: not UTF-8 text (byte {e.start}); a caption file holds UTF-8") from None


def read_source_captions(files: FileTree, names: list[str]) -> dict[str, str] | None:
    """{image name: caption} of a folder or ZIP of images (metadata.jsonl files and NAME.txt files), None when it
    has neither; CaptionError for a caption that is not text, an image without or with two captions, an empty
    metadata.jsonl or a line naming no image."""
    from_metadata: dict[str, str] = {}
    metadata = [name for name in files.names if posixpath.basename(name) == METADATA_FILE]
    images = set(names)
    for name in metadata:
        found = _metadata_captions(files, name, images)
        again = next((image for image in found if image in from_metadata), None)
        if again is not None:
            raise CaptionError(f"{files.path}: {shown(again)} has a caption in two {METADATA_FILE} files (the "
                               f"second: {shown(name)}); give each image one")
        from_metadata.update(found)
    stems = {os.path.splitext(name)[0]: name for name in files.names if name.lower().endswith(".txt")}
    from_text = {name: stems[os.path.splitext(name)[0]] for name in names if os.path.splitext(name)[0] in stems}
    if not metadata and not from_text:
        return None
    twice = [name for name in from_text if name in from_metadata]
    if twice:
        raise CaptionError(f"{files.path}: {shown(twice[0])} has a caption in {METADATA_FILE} and in "
                           f"{shown(from_text[twice[0]])}; give each image one ({len(twice)} images have two)")
    missing = [name for name in names if name not in from_metadata and name not in from_text]
    if missing:
        raise CaptionError(f"{files.path}: {shown(missing[0])} has no caption ({len(missing)} of {len(names)} "
                           f"images have none); give every image one, possibly empty (an empty NAME.txt)")
    captions = dict(from_metadata)
    for name, text_file in from_text.items():
        captions[name] = caption_text(files.read(text_file, limit=MAX_CAPTION_BYTES + 1), f"{files.path}: "
                                      f"{shown(text_file)}")
    return {name: captions[name] for name in names}


def _metadata_captions(files: FileTree, name: str, images: set[str]) -> dict[str, str]:
    """{image name: caption} of one metadata.jsonl, whose file names are relative to its folder."""
    folder = posixpath.dirname(name)
    where = f"{files.path}: {shown(name)}"
    lines = files.read(name, limit=bounded_json.MAX_BYTES).splitlines()
    captions: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        at = f"{where} line {number}"
        try:
            entry = bounded_json.parse(line, at)
        except bounded_json.JSONFileError as e:
            raise CaptionError(str(e)) from None
        if not isinstance(entry, dict) or not isinstance(entry.get("file_name"), str) or "text" not in entry:
            raise CaptionError(f'{at}: not an object {{"file_name": NAME, "text": CAPTION}}')
        image = posixpath.normpath(posixpath.join(folder, entry["file_name"]))
        if image not in images:
            raise CaptionError(f"{at}: names {shown(entry['file_name'])}, which is no image of {shown(files.path)}")
        if image in captions:
            raise CaptionError(f"{at}: gives {shown(entry['file_name'])} a second caption")
        captions[image] = check_caption(entry["text"], at)
    if not captions:
        raise CaptionError(f"{where} is empty; it gives each image a caption, one JSON object a line")
    return captions


def captions_record(captions: dict[str, str]) -> list[list[str]]:
    """dataset.json's "captions": [[name, caption], ...] in the order given."""
    return [[name, text] for name, text in captions.items()]


def parse_captions(stored: object, names: list[str], where: str) -> list[str] | None:
    """The captions a parsed dataset.json gives `names`, in that order; None when it records none. Every name must
    have one, and each must be text (check_caption)."""
    listed = stored.get(CAPTIONS_KEY) if isinstance(stored, dict) else None
    if listed is None:
        return None
    if not isinstance(listed, list) or not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                                               for e in listed):
        raise CaptionError(f"{where}: {CAPTIONS_KEY} is not a list of [name, caption] pairs")
    captions = {name: text for name, text in listed}
    if len(captions) < len(listed):
        raise CaptionError(f"{where}: {CAPTIONS_KEY} lists an image twice")
    missing = [name for name in names if name not in captions]
    if missing:
        raise CaptionError(f"{where}: {CAPTIONS_KEY} has no caption for {shown(missing[0])} ({len(missing)} images "
                           f"without one)")
    return [check_caption(captions[name], f"{where}: {CAPTIONS_KEY} of {shown(name)}") for name in names]


def read_dataset_captions(files: FileTree, names: list[str]) -> list[str] | None:
    """The captions dataset.json gives `names`, in that order; None without dataset.json or without captions."""
    if LABELS_FILE not in files.names:
        return None
    where = f"{files.path}: {LABELS_FILE}"
    try:
        stored = bounded_json.parse(files.read(LABELS_FILE, limit=bounded_json.MAX_BYTES), where)
    except (OSError, zipfile.BadZipFile, bounded_json.JSONFileError) as e:
        raise DatasetError(f"{files.path}: cannot read {LABELS_FILE} ({one_line(e)})") from None
    return parse_captions(stored, names, where)


def caption_or_none(dataset: object, idx: int) -> str | None:
    """Item idx's caption in a dataset (ImageData), None when the dataset has no captions."""
    return dataset.get_caption(idx) if dataset.has_captions else None
