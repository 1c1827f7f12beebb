"""JSON read back from files, bounded in size, nesting depth and numbers before the parser builds anything.

Python's json module recurses once per nesting level (100,000 nested lists end in a RecursionError, a
traceback), converts any run of digits into an int (a 5,000-digit number costs quadratic time, and Python
refuses more than 4,300 digits with a ValueError), accepts NaN and Infinity, and keeps the last of a key given
twice. Every JSON file the project
reads back (options, labels, statistics rows, locks, snapshot metadata) goes through `parse` or `read`, which
refuse each of these with one line naming the file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from edm2.errors import EDM2Error
from edm2.runtime import files

MAX_DEPTH = 32  # our files nest three or four levels; 32 leaves room without risking the recursion limit
MAX_INT_DIGITS = 20  # enough for any count of images, seed (< 2**64) or size the project writes
MAX_BYTES = 64 << 20  # dataset.json of ImageNet (1.28M labels) is about 30 MB

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


class JSONFileError(EDM2Error):
    """A JSON file or text is malformed, too large, too deeply nested, or holds a number out of bounds."""


def nesting_depth(text: bytes) -> int:
    """The deepest nesting of [ and { outside strings, counted without parsing (linear time, no recursion)."""
    bare = np.frombuffer(_STRING.sub(b'""', text), dtype=np.uint8)
    if bare.size == 0:
        return 0
    step = np.zeros(bare.shape, dtype=np.int64)
    step[(bare == ord("[")) | (bare == ord("{"))] = 1
    step[(bare == ord("]")) | (bare == ord("}"))] = -1
    return int(np.cumsum(step).max(initial=0))


def parse(text: str | bytes, source: str, max_depth: int = MAX_DEPTH, max_bytes: int = MAX_BYTES) -> Any:
    """Parse JSON `text` read from `source` (a file name, for the message); refuse what is out of bounds.

    Refused with JSONFileError: more than max_bytes, nesting deeper than max_depth, an integer of more than
    MAX_INT_DIGITS digits, a float that overflows to infinity, NaN or Infinity, a key given twice in one object
    (which value was meant is unknowable), and malformed JSON.
    """
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    if len(raw) > max_bytes:
        raise JSONFileError(f"{source}: {len(raw)} bytes of JSON, more than the {max_bytes} this file may hold")
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise JSONFileError(f"{source}: JSON nested {depth} levels deep, more than the {max_depth} allowed")
    try:
        return json.loads(raw, parse_int=lambda s: _integer(s, source), parse_float=lambda s: _float(s, source),
                          parse_constant=lambda s: _constant(s, source),
                          object_pairs_hook=lambda pairs: _object(pairs, source))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        if isinstance(e, JSONFileError):
            raise
        raise JSONFileError(f"{source}: not valid JSON ({str(e).splitlines()[0][:200]})") from None


def read(path: str | os.PathLike, max_depth: int = MAX_DEPTH, max_bytes: int = MAX_BYTES) -> Any:
    """Parse the JSON file `path` with `parse`'s bounds, reading no more than max_bytes + 1 bytes of it."""
    path = Path(path)
    with files.open_input(path) as f:  # a FIFO or device is refused, not waited on
        raw = f.read(max_bytes + 1)
    return parse(raw, str(path), max_depth=max_depth, max_bytes=max_bytes)


def read_object(path: str | os.PathLike, error: type[EDM2Error] = JSONFileError) -> dict | None:
    """The JSON object in the file `path` (read with `read`'s bounds), or None when there is no such file; `error`,
    naming the file, when it cannot be read, is out of bounds or holds anything but an object."""
    try:
        data = read(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    except JSONFileError as e:
        raise error(str(e)) from None
    if not isinstance(data, dict):
        raise error(f"{path}: a JSON {type(data).__name__}, not an object")
    return data


def _integer(digits: str, source: str) -> int:
    """An integer of at most MAX_INT_DIGITS digits (checked as text, before converting)."""
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        shown = digits if len(digits) <= 30 else digits[:27] + "..."
        raise JSONFileError(f"{source}: the number {shown} has more than {MAX_INT_DIGITS} digits")
    return int(digits)


def _float(text: str, source: str) -> float:
    """A float that stays finite (1e400 would become inf)."""
    value = float(text)
    if not np.isfinite(value):
        raise JSONFileError(f"{source}: the number {text[:30]} is not finite in double precision")
    return value


def _object(pairs: list[tuple[str, Any]], source: str) -> dict:
    """An object whose keys are all different."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        shown = twice if len(twice) <= 40 and twice.isprintable() else repr(twice[:40])
        raise JSONFileError(f"{source}: the key {shown} appears twice in one object")
    return obj


def _constant(name: str, source: str) -> float:
    """NaN and Infinity are no JSON; Python's json would accept them."""
    raise JSONFileError(f"{source}: {name} is not a JSON number")
