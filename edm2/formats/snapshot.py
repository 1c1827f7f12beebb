"""Network snapshot files: safetensors weights plus JSON metadata; the release's .pkl files via a safe importer."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import safetensors
import safetensors.torch
import torch

import edm2.architectures  # noqa: F401  (every network family a snapshot may name)
from edm2.encoders import Encoder, encoder_from_config
from edm2.errors import SnapshotError, one_line
from edm2.families import UnknownFamily
from edm2.formats.release_pickle import load_release_pickle
from edm2.networks import Precond
from edm2.runtime import bounded_json, files

FORMAT_VERSION = 1
METADATA_KEY = "edm2"
# Image counts lie in [0, MAX_NIMG): every such count is exact as a float64 (JSON readers elsewhere), and at the
# release's 2**31 images per training it leaves a factor of four million.
MAX_NIMG = 2**53
# The dtypes a network's weights may be stored in: they are converted to float32 on loading.
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# A sigma_rel in a file name as read back: std_tag's digits, or any other number of decimals (a name written by hand).
STD_TAG = r"\d+\.\d+"
# PREFIX-KIMG[-NIMG]-STD.safetensors (ours, see snapshot_name) or .pkl (the release's raw snapshots).
SNAPSHOT_NAME = re.compile(
    rf"(?P<prefix>.+?)-(?P<kimg>\d{{7,}})(?:-(?P<nimg>\d+))?-(?P<std>{STD_TAG})\.(?P<ext>safetensors|pkl)")


def std_tag(std: float) -> str:
    """A sigma_rel as file names carry it: three decimals, as the release names its snapshots (0.050)."""
    return f"{std:.3f}"


def images_tag(nimg: int) -> str:
    """An image count as file names carry it: kimg = nimg // 1000 as 7 digits, plus '-{nimg}' unless nimg is a
    multiple of 1024.

    The release names files by kimg and reads a kimg back as the multiple of 1024 with that kimg; multiples
    of 1024 lie more than 1000 apart, so their names never collide and mean what the release's do. Any other
    count (a stop by SIGTERM, a duration off the intervals, batches that are not powers of two) could share
    its kimg with another count, so its name says the exact count: no file replaces one of another count.
    """
    kimg = f"{nimg // 1000:07d}"
    return kimg if nimg % 1024 == 0 else f"{kimg}-{nimg}"


def kimg_to_nimg(kimg: int) -> int | None:
    """Images seen for a release file name's kimg: the multiple of 1024 whose //1000 is kimg, if any."""
    nimg = -(-kimg * 1000 // 1024) * 1024
    return nimg if nimg // 1000 == kimg else None


def snapshot_name(prefix: str, nimg: int, std: float) -> str:
    """File name of an EMA snapshot or a reconstruction: {prefix}-{images_tag(nimg)}-{std_tag(std)}.safetensors."""
    return f"{prefix}-{images_tag(nimg)}-{std_tag(std)}.safetensors"


def save_network(path: str | os.PathLike, net: torch.nn.Module, metadata: dict, key: str = METADATA_KEY,
                 dtype: torch.dtype = torch.float16) -> None:
    """Write net's weights (floating-point ones as dtype: float16, like the release) and metadata atomically to a
    .safetensors file; `key` and `dtype` serve another kind of our files (the toy example's, float32)."""
    meta = dict(metadata, format_version=FORMAT_VERSION, network_kwargs=net.init_kwargs)
    save_state(path, net.state_dict(), meta, key, dtype)


def save_state(path: str | os.PathLike, state: dict[str, torch.Tensor], metadata: dict, key: str,
               dtype: torch.dtype) -> None:
    """Write a state dict (floating-point tensors as dtype) and JSON metadata under `key` atomically to a
    .safetensors file; also the post-hoc EMA tracks of any module (edm2.procedures.anyema)."""
    # One fresh CPU tensor per name (a conversion is that copy): safetensors refuses tied weights' shared storage.
    tensors = {name: t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype, copy=True).contiguous()
               for name, t in state.items()}
    with files.atomic_path(path) as tmp:
        try:
            safetensors.torch.save_file(tensors, str(tmp), metadata={key: json.dumps(metadata)})
        except safetensors.SafetensorError as e:  # a full disk reads 'I/O error: No space left on device'
            raise SnapshotError(f"{path}: cannot write: {e}") from None


def check_readable(path: str | os.PathLike) -> None:
    """Raise SnapshotError with the real reason (no such file, a folder, no permission) unless path can be read."""
    try:
        # Opening is the only true test (permissions, ACLs, root's powers); safetensors reports a refusal as
        # 'No such file or directory'. open_input refuses a FIFO (it would wait for a writer) or a device.
        with files.open_input(path):
            pass
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SnapshotError(f"{path}: is a folder, not a file") from None
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e.strerror or e}") from None


def read_metadata(path: str | os.PathLike, key: str = METADATA_KEY, kind: str = "an EDM2 snapshot") -> dict:
    """The JSON metadata of one of our snapshot files, without reading its weights; `key` and `kind` name
    another kind of our safetensors files (the toy example's)."""
    check_readable(path)
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(key)
    except (OSError, safetensors.SafetensorError) as e:
        raise SnapshotError(f"{path}: cannot read snapshot: {e}") from None
    if raw is None:
        raise SnapshotError(f"{path}: not {kind} (no '{key}' metadata)")
    try:
        metadata = bounded_json.parse(raw, f"its '{key}' metadata")
    except bounded_json.JSONFileError as e:
        raise SnapshotError(f"{path}: {e}") from None
    if not isinstance(metadata, dict):
        raise SnapshotError(f"{path}: its '{key}' metadata is a JSON {type(metadata).__name__}, not an object")
    version = metadata.get("format_version")
    if type(version) is not int or version < 1:
        raise SnapshotError(f"{path}: metadata has no valid format_version (found {version!r})")
    if version > FORMAT_VERSION:
        raise SnapshotError(f"{path}: format_version {version}, but this edm2 reads up to {FORMAT_VERSION}: "
                            "made by a newer edm2; upgrade")
    nimg = metadata.get("nimg", 0)
    if type(nimg) is not int or not 0 <= nimg < MAX_NIMG:
        raise SnapshotError(f"{path}: metadata says {nimg!r} images seen; an image count is an integer in "
                            f"[0, 2**53)")
    return metadata


def architecture(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes: what must agree for weights to fit a network, or for networks to be averaged."""
    return {name: tuple(t.shape) for name, t in state.items()}


def architecture_difference(a: dict[str, tuple[int, ...]], b: dict[str, tuple[int, ...]]) -> str | None:
    """The first tensor name (in sorted order) that only one architecture has, or has with another shape."""
    differing = sorted(set(a.items()) ^ set(b.items()))
    return differing[0][0] if differing else None


def _build_network(path: Path, network_kwargs: object) -> Precond:
    """A Precond of the stored family from its stored constructor arguments (no family recorded: the release's
    U-Net), on the 'meta' device: no memory or time spent on weights."""
    if not isinstance(network_kwargs, dict):
        raise SnapshotError(f"{path}: metadata lacks the network's constructor arguments ('network_kwargs')")
    try:
        with torch.device("meta"):
            return Precond(**network_kwargs)
    except UnknownFamily as e:
        raise SnapshotError(f"{path}: its network is of a family that is not registered ({e}); register it "
                            "(edm2.architectures) to load this snapshot") from None
    except Exception as e:  # arguments from a file can fail in any way (TypeError, IndexError, ZeroDivisionError...)
        raise SnapshotError(f"{path}: unsupported network arguments {network_kwargs}: {one_line(e)}") from None


def load_weights(path: str | os.PathLike, net: torch.nn.Module) -> None:
    """Assign the weights of one of our safetensors files, as float32, to net (built as its metadata says, also on
    'meta'); SnapshotError unless every tensor's name and shape fits."""
    try:
        state = safetensors.torch.load_file(str(path))
    except (OSError, safetensors.SafetensorError) as e:
        raise SnapshotError(f"{path}: cannot read weights: {e}") from None
    difference = architecture_difference(architecture(state), architecture(net.state_dict()))
    if difference is not None:
        raise SnapshotError(f"{path}: weights do not match the stored architecture (tensor {difference!r})")
    wrong = next((name for name, t in state.items() if t.dtype not in WEIGHT_DTYPES), None)
    if wrong is not None:
        raise SnapshotError(f"{path}: tensor {wrong!r} is stored as {str(state[wrong].dtype).removeprefix('torch.')}; "
                            "weights are float16, bfloat16, float32 or float64")
    check_finite(path, state)
    net.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True, assign=True)


def check_finite(path: str | os.PathLike, state: dict[str, torch.Tensor]) -> None:
    """Refuse weights holding NaN or infinity (a diverged training samples black images without a word)."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise SnapshotError(f"{path}: tensor {name!r} holds NaN or infinite weights; the training that wrote it "
                                "diverged or the file is damaged")


def _load_safetensors(path: Path) -> tuple[Precond, dict]:
    """(net, metadata) from one of our snapshot files; the weights are assigned to a network built on 'meta'."""
    metadata = read_metadata(path)
    net = _build_network(path, metadata.get("network_kwargs"))
    load_weights(path, net)
    return net, metadata


def load_network(path_or_url: str | os.PathLike) -> tuple[Precond, dict]:
    """Load (net, metadata) from our .safetensors snapshot or the release's .pkl; net is float32, eval."""
    path = files.cached_path(path_or_url)
    check_readable(path)
    if str(path).endswith(".pkl"):
        net, metadata = load_release_pickle(path)
        check_finite(path, net.state_dict())
    else:
        net, metadata = _load_safetensors(path)
    net.eval().requires_grad_(False)
    return net, metadata


def load_generator(path_or_url: str | os.PathLike) -> tuple[Precond, Encoder, dict]:
    """load_network plus the encoder that turns the network's output into pixels."""
    net, metadata = load_network(path_or_url)
    try:
        encoder = encoder_from_config(metadata["encoder"])
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"{path_or_url}: no usable encoder settings ({e!r})") from None
    return net, encoder, metadata
