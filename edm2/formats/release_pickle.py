"""Import the official EDM2 release's .pkl files without running any code they embed.

The release pickles its classes through `torch_utils.persistence`, which stores each object as a call
`_reconstruct_persistent_obj(meta)` carrying the defining module's source. A plain `pickle.load` would
execute that source; here a restricted unpickler maps every allowed global to a safe stand-in, keeps
each persistent object as a record of its class name and state, and rebuilds our own objects from the
records: `Precond` from its constructor arguments and weights, the encoder and loss as plain settings
(pickles without them, older and third-party ones, get the RGB encoder and no loss). The toy example's
`ToyModel` snapshots are read by edm2.toy.snapshot with the public helpers here (restricted_load, reading,
expect_record, rebuild_module), so that the file formats know nothing of the toy example.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from edm2.encoders import StabilityVAEEncoder, StandardRGBEncoder
from edm2.errors import SnapshotError, one_line
from edm2.formats import legacy_storage, safe_pickle
from edm2.layers import ArchitectureError
from edm2.network_args import MAX_SCALE, real
from edm2.networks import Precond
from edm2.runtime import files


MAX_KWARGS_DEPTH = 16  # dataset_kwargs nest one or two levels; our metadata JSON may nest 32 in all
MAX_LOG_SIGMA = 100.0  # P_mean and P_std are on the scale of ln(sigma): the release's are -0.4 and 1.0


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


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    """Stand-in for torch._utils._rebuild_tensor_v2: a view that lies inside its storage, no hooks, no grad."""
    if not isinstance(storage, legacy_storage.Storage):
        raise ReleasePickleError(f"tensor built from {type(storage).__name__}, not a storage")
    if backward_hooks:
        raise ReleasePickleError("tensor carries backward hooks")
    return legacy_storage.tensor_view(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    """Stand-in for torch._utils._rebuild_parameter: the plain tensor is all we need."""
    if not isinstance(data, torch.Tensor) or backward_hooks:
        raise ReleasePickleError("malformed parameter")
    return data


# Every global the release's pickles use (as found in its published .pkl files) and what it becomes here.
_ALLOWED_GLOBALS = {
    ("torch_utils.persistence", "_reconstruct_persistent_obj"): _persistent_record,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("dnnlib.util", "EasyDict"): dict,
    ("numpy", "dtype"): np.dtype,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy.core.multiarray", "_reconstruct"): safe_pickle.reconstruct_array,
    ("numpy._core.multiarray", "_reconstruct"): safe_pickle.reconstruct_array,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch.storage", "_load_from_bytes"): legacy_storage.read_storage,
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


def expect_record(record: object, class_names: tuple[str, ...], what: str) -> PersistentRecord:
    """The record itself when it is a persistent object of one of class_names; otherwise refused, naming `what`."""
    if not isinstance(record, PersistentRecord) or record.class_name not in class_names:
        found = record.class_name if isinstance(record, PersistentRecord) else type(record).__name__
        raise ReleasePickleError(f"{what}: expected {' or '.join(class_names)}, found {found}")
    return record


def rebuild_module(record: PersistentRecord, module_class: type, what: str) -> torch.nn.Module:
    """Our module_class built from the recorded constructor arguments and given the recorded weights; float32, eval.

    It is built on the 'meta' device first (no memory), so that arguments declaring a network larger than the
    weights in the file are refused before anything is allocated; the file's tensors then become its weights.
    """
    args, kwargs = record.state.get("_init_args") or (), dict(record.state.get("_init_kwargs") or {})
    name = module_class.__name__
    try:
        with torch.device("meta"):
            net = module_class(*args, **kwargs)
    except (TypeError, ArchitectureError) as e:
        raise ReleasePickleError(f"{what}'s constructor arguments do not fit {name}: {one_line(e)}") from None
    tensors: dict[str, torch.Tensor] = {}
    _module_tensors(record.state, "", tensors)
    expected = {key: list(t.shape) for key, t in net.state_dict().items()}
    found = {key: list(t.shape) for key, t in tensors.items()}
    for key in [*expected, *found]:  # the network's order, then what only the file has
        if expected.get(key) != found.get(key):
            raise ReleasePickleError(f"{what}'s weights do not match the {name} its constructor arguments describe: "
                                     f"{key!r} is {found.get(key, 'missing')} in the file, "
                                     f"{expected.get(key, 'not a weight')} in the {name}")
    net.load_state_dict(tensors, strict=True, assign=True)
    return net.float().eval().requires_grad_(False)


def _encoder_config(record: PersistentRecord | None) -> dict:
    """Encoder settings as the config dict of edm2.encoders; without an entry, RGB pixels, as the release assumes
    (generate_images.py falls back to StandardRGBEncoder for pickles that predate the encoder entry)."""
    if record is None:
        return StandardRGBEncoder().config()
    record = expect_record(record, ("StabilityVAEEncoder", "StandardRGBEncoder"), "encoder")
    if record.class_name == "StandardRGBEncoder":
        return StandardRGBEncoder().config()
    state = record.state
    scale, bias = (np.asarray(state[k], dtype=np.float32).ravel() for k in ("scale", "bias"))
    return StabilityVAEEncoder.from_scale_bias(str(state["vae_name"]), scale, bias, int(state["batch_size"])).config()


def _plain(value, depth: int = 0):
    """Recursively turn pickled containers and NumPy values into JSON-friendly Python values (at most
    MAX_KWARGS_DEPTH levels: the metadata we write them into must stay readable by edm2.runtime.bounded_json)."""
    if isinstance(value, (dict, list, tuple)) and depth >= MAX_KWARGS_DEPTH:
        raise ReleasePickleError(f"dataset_kwargs nested more than {MAX_KWARGS_DEPTH} levels deep")
    if isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ReleasePickleError(f"unexpected {type(value).__name__} in dataset_kwargs")


def _loss_settings(state: dict) -> dict[str, float]:
    """The loss's P_mean, P_std and sigma_data (Eq. 16, 21), each a finite number in a sane range."""
    try:
        return dict(P_mean=real("P_mean", state["P_mean"], -MAX_LOG_SIGMA, MAX_LOG_SIGMA),
                    P_std=real("P_std", state["P_std"], 0, MAX_LOG_SIGMA, low_open=True),
                    sigma_data=real("sigma_data", state["sigma_data"], 0, MAX_SCALE, low_open=True))
    except ArchitectureError as e:
        raise ReleasePickleError(f"loss_fn: {e}") from None


def restricted_load(path: str | os.PathLike) -> object:
    """The release pickle's contents, persistent objects as records; nothing in it runs."""
    with files.open_input(path) as f:
        try:
            return safe_pickle.restricted_load(f, _ALLOWED_GLOBALS, "not part of the release's format")
        except (ReleasePickleError, safe_pickle.RefusedGlobal) as e:
            raise ReleasePickleError(f"{path}: {e}") from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
            # The unpickler's own checks (safe_pickle.RefusedPickle: sizes, depth, storages) say what they found.
            detail = e if isinstance(e, safe_pickle.RefusedPickle) else f"{e.__class__.__name__}: {e}"
            raise ReleasePickleError(f"{path}: not a readable release pickle ({detail})") from None


@contextlib.contextmanager
def reading(path: str | os.PathLike) -> Iterator[None]:
    """Refusals, and entries of other types than the release's, as one ReleasePickleError naming the file."""
    try:
        yield
    except ReleasePickleError as e:
        raise ReleasePickleError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ReleasePickleError(f"{path}: malformed release pickle ({e.__class__.__name__}: {str(e)[:200]})") from None


def load_release_pickle(path: str | os.PathLike) -> tuple[Precond, dict]:
    """Read a release .pkl into (our Precond in eval mode, float32; metadata) without running its code."""
    data = restricted_load(path)
    if not isinstance(data, dict) or "ema" not in data:
        raise ReleasePickleError(f"{path}: expected a dict with an 'ema' network")
    with reading(path):
        net = rebuild_module(expect_record(data["ema"], ("Precond",), "ema"), Precond, "the release network")
        metadata = {
            "source": "release-pickle",
            "network_kwargs": net.init_kwargs,
            "encoder": _encoder_config(data.get("encoder")),
            "dataset_kwargs": _plain(data.get("dataset_kwargs") or {}),
        }
        # Older and third-party pickles carry no loss; the network and encoder are all that sampling needs.
        if data.get("loss_fn") is not None:
            metadata["loss"] = _loss_settings(expect_record(data["loss_fn"], ("EDM2Loss",), "loss_fn").state)
    return net, metadata

