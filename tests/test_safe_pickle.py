"""Restricted unpickling: only allowlisted globals resolve; nothing else is imported or run."""

import codecs
import collections
import io
import os
import pickle
import pickletools
import re
import struct
import tracemalloc

import numpy as np
import pytest

from edm2.errors import EDM2Error
from edm2.formats import safe_pickle


class RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


class WithPersistentId(pickle.Pickler):
    def persistent_id(self, obj):
        return "id" if isinstance(obj, str) and obj == "external" else None


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_numpy_arrays_and_allowed_containers_load(protocol):
    data = collections.OrderedDict(a=np.arange(6, dtype=np.float32).reshape(2, 3), b=np.float64(1.5))
    blob = pickle.dumps(data, protocol=protocol)
    # Protocol 2 stores bytes through _codecs.encode.
    allowed = {**safe_pickle.numpy_globals(), ("collections", "OrderedDict"): collections.OrderedDict,
               ("_codecs", "encode"): codecs.encode}
    loaded = safe_pickle.restricted_load(io.BytesIO(blob), allowed, "test data")
    assert list(loaded) == ["a", "b"] and np.array_equal(loaded["a"], data["a"]) and loaded["b"] == 1.5


def test_other_globals_and_persistent_ids_are_refused():
    # A library error, and still an UnpicklingError for code that catches the unpickler's errors.
    assert issubclass(safe_pickle.RefusedGlobal, EDM2Error)
    assert issubclass(safe_pickle.RefusedGlobal, pickle.UnpicklingError)
    with pytest.raises(safe_pickle.RefusedGlobal, match=r"refusing to load '(posix|os)\.system': only arrays"):
        safe_pickle.restricted_load(io.BytesIO(pickle.dumps([RunsCode()])), {}, "only arrays")
    buffer = io.BytesIO()
    WithPersistentId(buffer).dump(["external"])
    buffer.seek(0)
    with pytest.raises(safe_pickle.RefusedGlobal, match="persistent ids"):
        safe_pickle.restricted_load(buffer, {}, "only arrays")


def load(stream: bytes, allowed=None) -> object:
    return safe_pickle.restricted_load(io.BytesIO(stream), allowed or {}, "test data")


@pytest.mark.parametrize("stream, message", [
    (b"\x80\x04\x8e" + struct.pack("<Q", 3 << 30) + b"abc", "expected 3221225472 bytes in a bytes8, but only 3 remain"),
    (b"\x80\x04\x95" + struct.pack("<Q", 3 << 30) + b"N.", "a frame of 3221225472 bytes at byte 2, but only 2 follow"),
    (b"\x80\x02]r" + struct.pack("<I", 0xFFFFFFF0) + b".", "memo index 4294967280 at byte 3, after only 2 opcodes"),
], ids=["bytes8", "frame", "memo index"])
def test_sizes_the_stream_declares_are_checked_against_the_file_before_allocating(stream, message):
    # Python's unpickler allocates a counted string, a frame or a memo of the size declared before reading it:
    # 3 GiB here, or 32 GiB of memo for the index. Refused first, the load allocates less than a MiB.
    tracemalloc.start()
    try:
        with pytest.raises(safe_pickle.RefusedPickle, match=re.escape(message)):
            load(stream)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_the_number_of_opcodes_is_bounded(monkeypatch):
    limit = len(list(pickletools.genops(pickle.dumps([None] * 19))))
    monkeypatch.setattr(safe_pickle, "MAX_OPCODES", limit)
    assert load(pickle.dumps([None] * 19)) == [None] * 19
    with pytest.raises(safe_pickle.RefusedPickle, match=f"more than {limit} opcodes"):
        load(pickle.dumps([None] * 20))  # one NONE more


def nested(levels: int) -> list:
    value = []
    for _ in range(levels):
        value = [value]
    return value


def test_structures_too_deep_self_referencing_or_too_large_are_refused():
    assert load(pickle.dumps(nested(safe_pickle.MAX_DEPTH))) == nested(safe_pickle.MAX_DEPTH)
    with pytest.raises(safe_pickle.RefusedPickle, match=f"nested more than {safe_pickle.MAX_DEPTH} levels deep"):
        load(pickle.dumps(nested(safe_pickle.MAX_DEPTH + 1)))
    cyclic = {"a": [1, 2]}
    cyclic["a"].append(cyclic)
    with pytest.raises(safe_pickle.RefusedPickle, match="a dict that contains itself"):
        load(pickle.dumps(cyclic))
    # 21 levels of [x, x]: a stream of a few hundred bytes, 2^22 - 1 objects for a walk that follows references.
    doubling = [0]
    for _ in range(21):
        doubling = [doubling, doubling]
    assert len(pickle.dumps(doubling)) < 1000
    with pytest.raises(safe_pickle.RefusedPickle, match=f"a structure of more than {safe_pickle.MAX_NODES} objects"):
        load(pickle.dumps(doubling))
    shared = [[0] * 10] * 1000  # 11,001 objects reached: shared, but well within the bound
    assert load(pickle.dumps(shared)) == shared


class ArrayState:
    """Unpickles as NumPy unpickles an array: an empty array from _reconstruct, then the given state."""

    def __init__(self, state, shape=(0,)):
        self.state, self.shape = state, shape

    def __reduce__(self):
        return (np.zeros(0).__reduce__()[0], (np.ndarray, self.shape, b"b"), self.state)


@pytest.mark.parametrize("array, message", [
    (ArrayState((1, (10**7, 10**7), np.dtype("f4"), False, b"1234")),
     "an array of shape (10000000, 10000000) and float32 needs 400000000000000 bytes; the pickle gives 4"),
    (ArrayState((1, (2,), np.dtype(object), False, [1, 2])), "only arrays of numbers are read"),
    (ArrayState(None, shape=(10**7, 10**7)), "an array rebuilt with elements before its data"),
], ids=["bytes", "objects", "reconstruct"])
def test_arrays_must_hold_the_bytes_their_shape_needs(array, message):
    tracemalloc.start()
    try:
        with pytest.raises(safe_pickle.RefusedPickle, match=re.escape(message)):
            load(pickle.dumps(array), safe_pickle.numpy_globals())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    honest = np.arange(12, dtype=np.float16).reshape(3, 4).T
    loaded = load(pickle.dumps(honest), safe_pickle.numpy_globals())
    assert loaded.dtype == np.float16 and np.array_equal(loaded, honest)
