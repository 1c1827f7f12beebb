"""Network snapshot files: safetensors weights plus JSON metadata; release pickles via a safe importer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from edm2 import files
from edm2.encoders import Encoder, encoder_from_config
from edm2.networks import Precond

FORMAT_VERSION = 1
METADATA_KEY = "edm2"


class SnapshotError(ValueError):
    """A network file is missing, unreadable, not one of ours, or (ReleasePickleError) an unsafe pickle."""


def snapshot_name(prefix: str, nimg: int, std: float) -> str:
    """File name of an EMA snapshot: {prefix}-{kimg:07d}-{std:.3f}.safetensors, kimg = nimg // 1000."""
    return f"{prefix}-{nimg // 1000:07d}-{std:.3f}.safetensors"


def save_network(path: str | os.PathLike, net: Precond, metadata: dict) -> None:
    """Write net's weights (float16, like the release) and metadata atomically to a .safetensors file."""
    meta = dict(metadata, format_version=FORMAT_VERSION, network_kwargs=net.init_kwargs)
    tensors = {}
    for name, tensor in net.state_dict().items():
        tensor = tensor.detach()
        if tensor.is_floating_point():
            tensor = tensor.to(torch.float16)
        tensors[name] = tensor.to("cpu").contiguous()
    with files.atomic_path(path) as tmp:
        safetensors.torch.save_file(tensors, str(tmp), metadata={METADATA_KEY: json.dumps(meta)})


def read_metadata(path: str | os.PathLike) -> dict:
    """The JSON metadata of one of our snapshot files, without reading its weights."""
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(METADATA_KEY)
    except (OSError, safetensors.SafetensorError) as e:
        raise SnapshotError(f"{path}: cannot read snapshot: {e}") from None
    if raw is None:
        raise SnapshotError(f"{path}: not an EDM2 snapshot (no '{METADATA_KEY}' metadata)")
    return json.loads(raw)


def build_network(network_kwargs: dict, device: str | torch.device = "cpu") -> Precond:
    """Construct a Precond from stored constructor arguments; on 'meta' it costs no memory or time."""
    try:
        with torch.device(device):
            return Precond(**network_kwargs)
    except TypeError as e:
        raise SnapshotError(f"unsupported network arguments {network_kwargs}: {e}") from None


def load_network(path_or_url: str | os.PathLike) -> tuple[Precond, dict]:
    """Load (net, metadata) from our .safetensors snapshot or the release's .pkl; net is float32, eval."""
    path = files.cached_path(path_or_url)
    if not Path(path).is_file():
        raise SnapshotError(f"{path_or_url}: no such file")
    if str(path).endswith(".pkl"):
        from edm2.release_pickle import load_release_pickle

        net, metadata = load_release_pickle(path)
    else:
        metadata = read_metadata(path)
        # Built on the meta device, so random initialization is skipped; the weights are assigned.
        net = build_network(metadata["network_kwargs"], device="meta")
        state = safetensors.torch.load_file(str(path))
        state = {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()}
        try:
            net.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:
            raise SnapshotError(f"{path_or_url}: weights do not match the stored architecture: {e}") from None
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
