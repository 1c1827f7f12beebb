"""Unpickling restricted to an allowlist of globals, so reading a pickle never runs code from it, and bounded: no
size the stream declares is allocated before it is checked against the bytes that follow, and the structure it
builds is checked for depth, cycles and size before anyone walks it."""

from __future__ import annotations

import math
import pickle
import pickletools
from typing import IO, Callable, Mapping

import numpy as np

from edm2.errors import EDM2Error

MAX_DEPTH = 64  # the release's network pickles nest about 20 levels (module, state, submodules, ...)
MAX_NODES = 1_000_000  # objects reached, shared ones once per reference; the XXL network pickle reaches about 10^4
MAX_OPCODES = 4 * MAX_NODES  # a 1-byte opcode can build a 64-byte object: this bounds what a small file builds
MAX_ARRAY_DIMS = 32  # NumPy's own limit (64 in NumPy 2) is beyond any array a statistics or network file holds
_MEMO_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")


class RefusedPickle(EDM2Error, pickle.UnpicklingError):
    """The pickle is refused: it names a global outside the allowlist, declares more than it holds, or builds a
    structure too deep, referring to itself, or too large.

    Also an UnpicklingError, so that code catching the unpickler's own errors catches it too.
    """


class RefusedGlobal(RefusedPickle):
    """The pickle names a global (or persistent id) outside the allowlist."""


class _Capped:
    """A file whose reads never ask for more than remains: BufferedReader.read(n) allocates n bytes before reading."""

    def __init__(self, file: IO[bytes], end: int):
        self.file, self.end = file, end

    def read(self, n: int = -1) -> bytes:
        """At most n bytes, and never more than remain."""
        remaining = self.end - self.file.tell()
        return self.file.read(remaining if n < 0 else min(n, remaining))

    def readline(self) -> bytes:
        """One line (text opcodes' arguments), at most the rest of the file."""
        return self.file.readline()

    def tell(self) -> int:
        """The position in the file."""
        return self.file.tell()


def check_stream(file: IO[bytes]) -> None:
    """Raise RefusedPickle unless every size the pickle at file's position declares fits the file: counted strings
    and bytes, frames, memo indices (the unpickler sizes its memo by the largest index) and the number of opcodes. Reads up to the STOP
    opcode, then returns to the starting position."""
    start = file.tell()
    end = file.seek(0, 2)
    file.seek(start)
    reader = _Capped(file, end)
    try:
        for count, (opcode, arg, pos) in enumerate(pickletools.genops(reader)):
            if count >= MAX_OPCODES:
                raise RefusedPickle(f"more than {MAX_OPCODES} opcodes")
            if opcode.name in _MEMO_PUTS and not 0 <= arg <= count:
                raise RefusedPickle(f"memo index {arg} at byte {pos}, after only {count} opcodes")
            if opcode.name == "FRAME" and arg > end - file.tell():
                raise RefusedPickle(f"a frame of {arg} bytes at byte {pos}, but only {end - file.tell()} follow")
    except ValueError as e:  # genops: truncated arguments ('expected N bytes ... but only M remain'), bad opcodes
        raise RefusedPickle(f"malformed pickle ({str(e)[:200]})") from None
    finally:
        file.seek(start)


def _children(obj: object) -> list:
    """What obj holds: the items of containers, the attributes of plain objects (the unpickler's records)."""
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, type):
        return []
    return list(getattr(obj, "__dict__", {}).values())


def check_structure(root: object, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> None:
    """Raise RefusedPickle if root holds more than max_depth nonempty containers one inside the other, holds a
    container inside itself, or reaches more than max_nodes objects counting a shared one once per reference (what a
    recursive walk would visit). Walks without recursion."""
    sizes: dict[int, int] = {}  # finished containers: how many objects a walk from them visits
    path = {id(root)}
    stack = [[root, iter(_children(root)), 1]]
    while stack:
        frame = stack[-1]
        child = next(frame[1], path)  # path: a sentinel no container holds
        if child is path:
            stack.pop()
            path.discard(id(frame[0]))
            sizes[id(frame[0])] = frame[2]
            if stack:
                stack[-1][2] += frame[2]
        elif id(child) in path:
            raise RefusedPickle(f"a {type(child).__name__} that contains itself")
        elif id(child) in sizes or not _children(child):
            frame[2] += sizes.get(id(child), 1)
        elif len(stack) >= max_depth:
            raise RefusedPickle(f"containers nested more than {max_depth} levels deep")
        else:
            path.add(id(child))
            stack.append([child, iter(_children(child)), 1])
        if stack and stack[-1][2] > max_nodes:
            raise RefusedPickle(f"a structure of more than {max_nodes} objects")


class CheckedArray(np.ndarray):
    """A NumPy array being unpickled: its state (shape, dtype, bytes) is checked before NumPy takes it."""

    def __setstate__(self, state: tuple) -> None:
        """ndarray.__setstate__ once the shape times the item size equals the bytes given, and no objects."""
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise RefusedPickle("malformed array state")
        shape, dtype, _, raw = state[-4:]
        if not isinstance(dtype, np.dtype) or dtype.hasobject:
            raise RefusedPickle(f"an array of {dtype!r}: only arrays of numbers are read")
        if (not isinstance(shape, tuple) or len(shape) > MAX_ARRAY_DIMS
                or not all(type(n) is int and 0 <= n < 2**63 for n in shape)):
            raise RefusedPickle("an array whose shape is not a tuple of sizes")
        if not isinstance(raw, (bytes, bytearray)) or math.prod(shape) * dtype.itemsize != len(raw):
            given = len(raw) if isinstance(raw, (bytes, bytearray)) else type(raw).__name__
            raise RefusedPickle(f"an array of shape {shape} and {dtype} needs {math.prod(shape) * dtype.itemsize} "
                                f"bytes; the pickle gives {given}")
        super().__setstate__(state)


def reconstruct_array(subtype: type, shape: tuple, dtype: object) -> np.ndarray:
    """Stand-in for numpy's multiarray._reconstruct: an empty array that __setstate__ fills after checking it.

    NumPy pickles every array as _reconstruct(ndarray, (0,), ...) plus a state holding the real shape and bytes;
    a nonempty shape here would allocate memory that no bytes in the file stand for.
    """
    if subtype is not np.ndarray:
        raise RefusedPickle(f"array subtype {subtype!r} is not numpy.ndarray")
    if not isinstance(shape, tuple) or not all(type(n) is int for n in shape) or math.prod(shape) != 0:
        raise RefusedPickle("an array rebuilt with elements before its data (NumPy pickles shape (0,))")
    return np.ndarray.__new__(CheckedArray, (0,), np.uint8)


def numpy_globals() -> dict[tuple[str, str], object]:
    """The NumPy callables that NumPy itself names in pickles of arrays, dtypes and scalars (arrays checked)."""
    frombuffer = np.zeros(1).__reduce_ex__(5)[0]  # a view of the bytes given, reshaped: nothing to allocate
    scalar = np.float64(0).__reduce__()[0]
    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for package in ("numpy.core", "numpy._core"):  # NumPy 1 and NumPy 2 spell the module differently
        allowed[(f"{package}.multiarray", "_reconstruct")] = reconstruct_array
        allowed[(f"{package}.multiarray", "scalar")] = scalar
        allowed[(f"{package}.numeric", "_frombuffer")] = frombuffer
    return allowed


def restricted_load(file: IO[bytes], allowed: Mapping[tuple[str, str], object], what: str,
                    persistent_load: Callable[[object], object] | None = None) -> object:
    """pickle.load resolving globals only through `allowed` (`what` tells, in a refusal, what may be there) and
    persistent ids only through `persistent_load`; the stream is checked first (check_stream) and the result
    after (check_structure). `file` must be seekable."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            try:
                return allowed[(module, name)]
            except KeyError:
                raise RefusedGlobal(f"refusing to load '{module}.{name}': {what}") from None

        def persistent_load(self, pid: object) -> object:
            if persistent_load is None:
                raise RefusedGlobal("refusing to load a pickle with persistent ids")
            return persistent_load(pid)

    check_stream(file)
    result = Unpickler(file).load()
    check_structure(result)
    return result
