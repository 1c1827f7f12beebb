"""Load a TorchScript file only after reading its code and finding nothing in it but tensor arithmetic.

A TorchScript file is a program: torch.jit.load compiles the code stored in the archive, and calling the model
runs it (a class's __setstate__ even runs while loading). Code that calls torch.from_file, torch.save or a
tensor's storage can read and write any file. Why keep running such a program for FID rather than re-implement
Inception-v3? FID is defined by what the published file (inception-2015-12-05.pt, StyleGAN2-ADA's TorchScript
conversion of TensorFlow's 2015 graph) computes, down to its resize and padding details; that file cannot be
downloaded where this code is tested to check a re-implementation against, and one that drifts silently breaks
every comparison with published numbers. So we keep the published program and check it first, as
edm2/safe_pickle.py does for pickles: a TorchScript archive is a ZIP whose code is Python-syntax text under
code/, so we parse every code file and accept it only if every statement, operator and name in it is on an
allowlist of tensor arithmetic (edm2/torchscript_allowlist.py), every pickle in it names only allowlisted
globals, and it holds no entry we do not know. Whatever is not listed is refused, before torch.jit.load sees a
byte of it; the bytes checked are the bytes loaded.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import zipfile
from pathlib import Path

import torch

from edm2 import torchscript_allowlist as allow
from edm2.torchscript_code import UnsafeTorchScript, check_code

# Archive entries relative to its top folder: code, pickles, raw tensor bytes, format metadata.
_CODE = re.compile(r"code/(__torch__(?:/\w+)*)\.py")
_PICKLE = re.compile(r"(data|constants)\.pkl|code/__torch__(?:/\w+)*\.py\.debug_pkl")
_OTHER = re.compile(r"(data|constants)/\d+|version|byteorder|\.data/(version|serialization_id)")
_MAX_TEXT_BYTES = 16 << 20  # code and pickles of a real model are kilobytes; a larger entry is not one


class _PickleStub:
    """Stands in for every object a checked pickle builds; it runs nothing."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


def _check_pickle(name: str, data: bytes, classes: set[str]) -> None:
    """Unpickle with every global resolved to a stub, refusing globals outside the allowlist and the archive's classes."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, qualname: str) -> type:
            if (module, qualname) in allow.PICKLE_GLOBALS or f"{module}.{qualname}" in classes:
                return _PickleStub
            raise UnsafeTorchScript(f"{name} names the global '{module}.{qualname}', which is not on the allowlist")

        def persistent_load(self, pid: object) -> object:
            return None  # tensor storages: raw bytes in data/, never code

    try:
        Unpickler(io.BytesIO(data)).load()
    except UnsafeTorchScript:
        raise
    except Exception as e:  # a malformed pickle can fail in many ways; each is a refusal
        raise UnsafeTorchScript(f"{name} is not a pickle TorchScript writes ({e.__class__.__name__}: {e})") from None


def _archive_entries(data: bytes) -> dict[str, bytes]:
    """{name relative to the archive's top folder: bytes} for code and pickles; refuses unknown or repeated entries."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise UnsafeTorchScript(f"not a TorchScript archive (a ZIP file): {e}") from None
    names = [info.filename for info in infos]
    if not names or len(set(names)) != len(names):
        raise UnsafeTorchScript("the archive is empty or names an entry twice")
    top = names[0].split("/")[0]
    entries = {}
    for info in infos:
        relative = info.filename[len(top) + 1:] if info.filename.startswith(top + "/") else None
        if relative is None or not (_CODE.fullmatch(relative) or _PICKLE.fullmatch(relative)
                                    or _OTHER.fullmatch(relative)):
            raise UnsafeTorchScript(f"the archive holds an entry TorchScript does not write: {info.filename}")
        if not _OTHER.fullmatch(relative):
            if info.file_size > _MAX_TEXT_BYTES:
                raise UnsafeTorchScript(f"{info.filename} is larger than any model's code")
            try:
                entries[relative] = archive.read(info)
            except Exception as e:  # encrypted, corrupt or oddly compressed entries all fail differently
                raise UnsafeTorchScript(f"cannot read {info.filename} ({e.__class__.__name__}: {e})") from None
    if "data.pkl" not in entries or not any(_CODE.fullmatch(name) for name in entries):
        raise UnsafeTorchScript("the archive holds no TorchScript code (a state dict or other ZIP file?)")
    return entries


def check_torchscript(data: bytes) -> None:
    """Raise UnsafeTorchScript unless the archive's code and pickles use only allowlisted tensor arithmetic."""
    entries = _archive_entries(data)
    classes = check_code({name: text for name, text in entries.items() if _CODE.fullmatch(name)})
    for name, content in entries.items():
        if _PICKLE.fullmatch(name):
            _check_pickle(name, content, classes)


def load_torchscript(path: str | os.PathLike, map_location: torch.device | str = "cpu") -> torch.jit.ScriptModule:
    """torch.jit.load of a file whose code check_torchscript accepts (the checked bytes are the loaded bytes)."""
    data = Path(path).read_bytes()
    check_torchscript(data)
    return torch.jit.load(io.BytesIO(data), map_location=map_location)
