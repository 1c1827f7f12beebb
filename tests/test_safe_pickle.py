"""Restricted unpickling: only allowlisted globals resolve; nothing else is imported or run."""

import codecs
import collections
import io
import os
import pickle

import numpy as np
import pytest

from edm2 import safe_pickle
from edm2.errors import EDM2Error


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
