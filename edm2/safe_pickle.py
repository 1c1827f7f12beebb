"""Unpickling restricted to an allowlist of globals, so reading a pickle never runs code from it."""

from __future__ import annotations

import pickle
from typing import IO, Mapping

import numpy as np

from edm2.errors import EDM2Error


class RefusedGlobal(EDM2Error, pickle.UnpicklingError):
    """The pickle names a global (or persistent id) outside the allowlist.

    Also an UnpicklingError, so that code catching the unpickler's own errors catches it too.
    """


def numpy_globals() -> dict[tuple[str, str], object]:
    """The NumPy callables that NumPy itself names in pickles of arrays, dtypes and scalars."""
    reconstruct = np.zeros(0).__reduce__()[0]
    frombuffer = np.zeros(1).__reduce_ex__(5)[0]
    scalar = np.float64(0).__reduce__()[0]
    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for package in ("numpy.core", "numpy._core"):  # NumPy 1 and NumPy 2 spell the module differently
        allowed[(f"{package}.multiarray", "_reconstruct")] = reconstruct
        allowed[(f"{package}.multiarray", "scalar")] = scalar
        allowed[(f"{package}.numeric", "_frombuffer")] = frombuffer
    return allowed


def restricted_load(file: IO[bytes], allowed: Mapping[tuple[str, str], object], what: str) -> object:
    """pickle.load resolving globals only through `allowed`; `what` tells, in a refusal, what may be there."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            try:
                return allowed[(module, name)]
            except KeyError:
                raise RefusedGlobal(f"refusing to load '{module}.{name}': {what}") from None

        def persistent_load(self, pid: object) -> object:
            raise RefusedGlobal("refusing to load a pickle with persistent ids")

    return Unpickler(file).load()
