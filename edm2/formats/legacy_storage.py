"""Tensor storages in torch's legacy serialization, read without torch.load, and tensor views checked to fit them.

Pickling a tensor pickles its storage as torch.save(storage) in the legacy format (TypedStorage.__reduce__), so
the release's network pickles embed one such record per tensor: three header pickles (magic number, protocol
version, system info), a pickle whose persistent id declares the storage ('storage', type, key, location, numel,
None), a pickle of the storage keys, then per key an int64 element count and the raw bytes. torch.load allocates
the declared size before reading; here the declared size must equal the bytes that follow, and a tensor view
(size, stride, offset) must lie inside its storage, where torch would grow the storage to fit it.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
from dataclasses import dataclass

import torch

from edm2.formats import safe_pickle
from edm2.formats.safe_pickle import RefusedPickle

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
PROTOCOL_VERSION = 1001  # torch.serialization.PROTOCOL_VERSION
MAX_DIMS = 64  # torch's own limit on a tensor's dimensions
_STORAGE_TYPES = {
    "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16, "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64, "ByteStorage": torch.uint8, "CharStorage": torch.int8,
    "ShortStorage": torch.int16, "IntStorage": torch.int32, "LongStorage": torch.int64, "BoolStorage": torch.bool,
}
_GLOBALS = {("torch", name): dtype for name, dtype in _STORAGE_TYPES.items()}
_WHAT = "only torch storage types belong there"


@dataclass(frozen=True)
class Storage:
    """A storage read from its record: its elements as a 1-D tensor."""

    data: torch.Tensor


@dataclass(frozen=True)
class _Declared:
    """What a storage's persistent id declares."""

    key: str
    dtype: torch.dtype
    numel: int


def _declared(pid: object) -> _Declared:
    """The persistent id torch's legacy format writes for a storage; nothing else."""
    if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
        raise RefusedPickle("embedded tensor data declares something other than a storage")
    _, dtype, key, location, numel, view = pid
    if (not isinstance(dtype, torch.dtype) or not isinstance(key, str) or not isinstance(location, str)
            or type(numel) is not int or not 0 <= numel < 2**62 or view is not None):
        raise RefusedPickle("embedded tensor data has a malformed storage declaration")
    return _Declared(key, dtype, numel)


def read_storage(blob: bytes) -> Storage:
    """The storage that torch.save(storage) (legacy format) wrote into blob; RefusedPickle unless the declared
    element count equals the bytes that follow. Stand-in for torch.storage._load_from_bytes."""
    if not isinstance(blob, (bytes, bytearray)):
        raise RefusedPickle(f"embedded tensor data is a {type(blob).__name__}, not bytes")
    f = io.BytesIO(blob)
    try:
        magic, version, sys_info = (safe_pickle.restricted_load(f, {}, _WHAT) for _ in range(3))
        if magic != MAGIC_NUMBER or version != PROTOCOL_VERSION or not isinstance(sys_info, dict):
            raise RefusedPickle("embedded tensor data is not in torch's legacy format")
        if sys_info.get("little_endian") is not True:
            raise RefusedPickle("embedded tensor data was written big-endian")
        declared = safe_pickle.restricted_load(f, _GLOBALS, _WHAT, persistent_load=_declared)
        keys = safe_pickle.restricted_load(f, {}, _WHAT)
    except safe_pickle.RefusedGlobal as e:
        raise RefusedPickle(f"embedded tensor data is not plain weights: {e}") from None
    except RefusedPickle:
        raise
    except (pickle.UnpicklingError, ValueError, TypeError, EOFError, KeyError, AttributeError) as e:
        raise RefusedPickle(f"embedded tensor data is not readable ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(declared, _Declared) or keys != [declared.key]:
        raise RefusedPickle("embedded tensor data holds something other than one storage")
    count = f.read(8)
    if len(count) != 8 or struct.unpack("<q", count)[0] != declared.numel:
        raise RefusedPickle(f"a storage declared as {declared.numel} elements is recorded with another count")
    nbytes, available = declared.numel * declared.dtype.itemsize, len(blob) - f.tell()
    if nbytes != available:
        raise RefusedPickle(f"a storage declares {declared.numel} elements of {declared.dtype} ({nbytes} bytes), "
                            f"but {available} bytes follow")
    data = bytearray(memoryview(blob)[f.tell():])
    return Storage(torch.frombuffer(data, dtype=declared.dtype) if nbytes else torch.empty(0, dtype=declared.dtype))


def tensor_view(storage: Storage, offset: object, size: object, stride: object) -> torch.Tensor:
    """The tensor of this size and stride at this offset of storage; RefusedPickle unless it lies inside the
    storage and holds no more elements than it (no overlapping views that copies would multiply)."""
    numbers = (offset, *size, *stride) if isinstance(size, tuple) and isinstance(stride, tuple) else ()
    if (not numbers or len(size) != len(stride) or len(size) > MAX_DIMS
            or not all(type(n) is int and 0 <= n < 2**62 for n in numbers)):
        raise RefusedPickle("a tensor whose offset, size or stride is not a tuple of sizes")
    numel, available = math.prod(size), storage.data.numel()
    last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if numel else -1
    if numel > available or last >= available or offset > available:
        raise RefusedPickle(f"a tensor of shape {list(size)} at offset {offset} does not fit its storage of "
                            f"{available} elements")
    return storage.data.as_strided(size, stride, offset)
