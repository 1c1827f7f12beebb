"""Import the official EDM2 release's .pkl files without running any code they embed.

The release pickles its classes through `torch_utils.persistence`, which stores each object as a call
`_reconstruct_persistent_obj(meta)` carrying the defining module's source. A plain `pickle.load` would
execute that source; here a restricted unpickler maps every allowed global to a safe stand-in, keeps
each persistent object as a record of its class name and state, and rebuilds our own objects from the
records: `Precond` from its constructor arguments and weights, the encoder and loss as plain settings
(pickles without them, older and third-party ones, get the RGB encoder and no loss), and the toy example's
`ToyModel` snapshots as our ToyDenoiser.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
from dataclasses import dataclass

import numpy as np
import torch

from edm2 import safe_pickle
from edm2.encoders import StabilityVAEEncoder, StandardRGBEncoder
from edm2.errors import SnapshotError, one_line
from edm2.networks import Precond
from edm2.toy_model import ToyDenoiser


class ReleasePickleError(SnapshotError):
    """The file is not a release pickle we can import safely; the message says why."""


@dataclass
class PersistentRecord:
    """What `_reconstruct_persistent_obj(meta)` would have rebuilt: class name and state, code left unrun."""

    class_name: str
    state: dict


class ModuleRecord:
    """State of a pickled plain torch module (ModuleDict) that only groups submodules."""

    def __setstate__(self, state: dict) -> None:
        self.state = state


def _persistent_record(meta: dict) -> PersistentRecord:
    """Stand-in for torch_utils.persistence._reconstruct_persistent_obj; never looks at meta['module_src']."""
    if not isinstance(meta, dict) or meta.get("type") != "class" or not isinstance(meta.get("class_name"), str):
        raise ReleasePickleError("malformed persistent object: expected type 'class' with a class_name")
    state = meta.get("state")
    if not isinstance(state, dict):
        raise ReleasePickleError(f"persistent object {meta['class_name']!r} has no state dict")
    return PersistentRecord(meta["class_name"], state)


def _load_storage(data: bytes) -> torch.storage.TypedStorage:
    """Stand-in for torch.storage._load_from_bytes that loads with weights_only=True."""
    try:
        storage = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # torch.load reports refused content with several exception types
        # Keep the line naming the refused global, not torch's generic advice around it.
        lines = [line for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        detail = next((line for line in lines if "global" in line.lower()), lines[0])
        raise ReleasePickleError(f"embedded tensor data is not plain weights: {detail}") from None
    if not isinstance(storage, torch.storage.TypedStorage):
        raise ReleasePickleError(f"expected a tensor storage, found {type(storage).__name__}")
    return storage


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    """Stand-in for torch._utils._rebuild_tensor_v2: a view of the storage, no hooks, no grad."""
    if not isinstance(storage, torch.storage.TypedStorage):
        raise ReleasePickleError(f"tensor built from {type(storage).__name__}, not a storage")
    if backward_hooks:
        raise ReleasePickleError("tensor carries backward hooks")
    return torch.empty(0, dtype=storage.dtype).set_(storage, storage_offset, tuple(size), tuple(stride))


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    """Stand-in for torch._utils._rebuild_parameter: the plain tensor is all we need."""
    if not isinstance(data, torch.Tensor) or backward_hooks:
        raise ReleasePickleError("malformed parameter")
    return data


def _reconstruct_ndarray(subtype, shape, dtype):
    """Stand-in for numpy's multiarray._reconstruct that only makes plain ndarrays."""
    if subtype is not np.ndarray:
        raise ReleasePickleError(f"array subtype {subtype!r} is not numpy.ndarray")
    return np.ndarray(shape, dtype)


# Every global the release's pickles use (as found in its published .pkl files) and what it becomes here.
_ALLOWED_GLOBALS = {
    ("torch_utils.persistence", "_reconstruct_persistent_obj"): _persistent_record,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("dnnlib.util", "EasyDict"): dict,
    ("numpy", "dtype"): np.dtype,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct_ndarray,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct_ndarray,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch.storage", "_load_from_bytes"): _load_storage,
    ("torch.nn.modules.container", "ModuleDict"): ModuleRecord,
    ("torch.nn.modules.container", "Sequential"): ModuleRecord,  # the toy example's layers
}


def _module_tensors(state: dict, prefix: str, out: dict[str, torch.Tensor]) -> None:
    """Walk a pickled module tree (_parameters, _buffers, _modules) into a flat state dict."""
    skip = state.get("_non_persistent_buffers_set") or set()
    for group in ("_parameters", "_buffers"):
        for name, tensor in (state.get(group) or {}).items():
            if tensor is not None and name not in skip:
                if not isinstance(tensor, torch.Tensor):
                    raise ReleasePickleError(f"{prefix}{name} is a {type(tensor).__name__}, not a tensor")
                out[prefix + name] = tensor
    for name, child in (state.get("_modules") or {}).items():
        if child is None:
            continue
        if not isinstance(child, (PersistentRecord, ModuleRecord)) or not hasattr(child, "state"):
            raise ReleasePickleError(f"submodule {prefix}{name} is not a pickled module")
        _module_tensors(child.state, f"{prefix}{name}.", out)


def _expect(record, class_names: tuple[str, ...], what: str) -> PersistentRecord:
    if not isinstance(record, PersistentRecord) or record.class_name not in class_names:
        found = record.class_name if isinstance(record, PersistentRecord) else type(record).__name__
        raise ReleasePickleError(f"{what}: expected {' or '.join(class_names)}, found {found}")
    return record


def _rebuild(record: PersistentRecord, module_class: type, what: str) -> torch.nn.Module:
    """Our module_class built from the recorded constructor arguments, weights loaded strictly; float32, eval."""
    args, kwargs = record.state.get("_init_args") or (), dict(record.state.get("_init_kwargs") or {})
    name = module_class.__name__
    try:
        net = module_class(*args, **kwargs)
    except TypeError as e:
        raise ReleasePickleError(f"{what}'s constructor arguments {kwargs} do not fit {name}: {e}") from None
    tensors: dict[str, torch.Tensor] = {}
    _module_tensors(record.state, "", tensors)
    try:
        net.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise ReleasePickleError(f"{what}'s weights do not match {name}: {one_line(e)}") from None
    return net.float().eval().requires_grad_(False)


def _encoder_config(record: PersistentRecord | None) -> dict:
    """Encoder settings as the config dict of edm2.encoders; without an entry, RGB pixels, as the release assumes
    (generate_images.py falls back to StandardRGBEncoder for pickles that predate the encoder entry)."""
    if record is None:
        return StandardRGBEncoder().config()
    record = _expect(record, ("StabilityVAEEncoder", "StandardRGBEncoder"), "encoder")
    if record.class_name == "StandardRGBEncoder":
        return StandardRGBEncoder().config()
    state = record.state
    scale, bias = (np.asarray(state[k], dtype=np.float32).ravel() for k in ("scale", "bias"))
    return StabilityVAEEncoder.from_scale_bias(str(state["vae_name"]), scale, bias, int(state["batch_size"])).config()


def _plain(value):
    """Recursively turn pickled containers and NumPy values into JSON-friendly Python values."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ReleasePickleError(f"unexpected {type(value).__name__} in dataset_kwargs")


def _restricted_load(path: str | os.PathLike) -> object:
    """The release pickle's contents, persistent objects as records; nothing in it runs."""
    with open(path, "rb") as f:
        try:
            return safe_pickle.restricted_load(f, _ALLOWED_GLOBALS, "not part of the release's format")
        except (ReleasePickleError, safe_pickle.RefusedGlobal) as e:
            raise ReleasePickleError(f"{path}: {e}") from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
            raise ReleasePickleError(f"{path}: not a readable release pickle ({e.__class__.__name__}: {e})") from None


def load_release_pickle(path: str | os.PathLike) -> tuple[Precond, dict]:
    """Read a release .pkl into (our Precond in eval mode, float32; metadata) without running its code."""
    data = _restricted_load(path)
    if not isinstance(data, dict) or "ema" not in data:
        raise ReleasePickleError(f"{path}: expected a dict with an 'ema' network")
    try:
        net = _rebuild(_expect(data["ema"], ("Precond",), "ema"), Precond, "the release network")
        metadata = {
            "source": "release-pickle",
            "network_kwargs": net.init_kwargs,
            "encoder": _encoder_config(data.get("encoder")),
            "dataset_kwargs": _plain(data.get("dataset_kwargs") or {}),
        }
        # Older and third-party pickles carry no loss; the network and encoder are all that sampling needs.
        if data.get("loss_fn") is not None:
            loss = _expect(data["loss_fn"], ("EDM2Loss",), "loss_fn").state
            metadata["loss"] = {k: float(loss[k]) for k in ("P_mean", "P_std", "sigma_data")}
    except ReleasePickleError as e:
        raise ReleasePickleError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ReleasePickleError(f"{path}: malformed release pickle ({e.__class__.__name__}: {e})") from None
    return net, metadata


def load_release_toy_pickle(path: str | os.PathLike) -> ToyDenoiser:
    """Read one of the release's toy-example snapshots (toy_example.py's iterNNNN.pkl: a pickled ToyModel) into
    our ToyDenoiser in eval mode, float32, without running its code."""
    record = _restricted_load(path)
    try:
        return _rebuild(_expect(record, ("ToyModel",), "toy example snapshot"), ToyDenoiser, "the toy model")
    except ReleasePickleError as e:
        raise ReleasePickleError(f"{path}: {e}") from None
