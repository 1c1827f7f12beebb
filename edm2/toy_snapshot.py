"""Toy-example snapshot files: the denoiser's safetensors weights plus JSON metadata; the release's toy pickles
through the restricted importer.

The metadata sits under its own key ('edm2-toy'), so an EDM2 command given a toy file, or the toy example given an
EDM2 snapshot, refuses it in one line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from edm2 import files
from edm2.errors import one_line
from edm2.release_pickle import load_release_toy_pickle
from edm2.snapshot import architecture, architecture_difference, check_readable
from edm2.toy_gmm import ToyError
from edm2.toy_model import ToyDenoiser

METADATA_KEY = "edm2-toy"
FORMAT_VERSION = 1


def save_toy(path: str | os.PathLike, net: ToyDenoiser, metadata: dict) -> None:
    """Write the denoiser's float32 weights and metadata atomically to a .safetensors file."""
    meta = dict(metadata, format_version=FORMAT_VERSION, network_kwargs=net.init_kwargs)
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in net.state_dict().items()}
    with files.atomic_path(path) as tmp:
        safetensors.torch.save_file(tensors, str(tmp), metadata={METADATA_KEY: json.dumps(meta)})


def _metadata(path: Path) -> dict:
    """The toy metadata of a safetensors file; ToyError unless it is one of ours of a version we read."""
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(METADATA_KEY)
    except (OSError, safetensors.SafetensorError) as e:
        raise ToyError(f"{path}: cannot read: {e}") from None
    if raw is None:
        raise ToyError(f"{path}: not a toy-example snapshot (no '{METADATA_KEY}' metadata)")
    try:
        metadata = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ToyError(f"{path}: its metadata is not valid JSON ({e})") from None
    if not isinstance(metadata, dict) or type(metadata.get("format_version")) is not int:
        raise ToyError(f"{path}: its metadata has no format_version")
    if metadata["format_version"] > FORMAT_VERSION:
        raise ToyError(f"{path}: format_version {metadata['format_version']}, made by a newer edm2; upgrade")
    return metadata


def load_toy(path_or_url: str | os.PathLike) -> tuple[ToyDenoiser, dict]:
    """(denoiser in eval mode, metadata) from our .safetensors toy snapshot or the release's toy .pkl (path or URL)."""
    path = files.cached_path(path_or_url)
    check_readable(path)
    if path.suffix == ".pkl":
        return load_release_toy_pickle(path), {"source": "release-pickle"}
    metadata = _metadata(path)
    try:
        net = ToyDenoiser(**metadata.get("network_kwargs", {}))
    except Exception as e:  # arguments from a file can fail in any way (TypeError, ValueError, RuntimeError...)
        raise ToyError(f"{path}: unsupported toy network arguments: {one_line(e)}") from None
    state = safetensors.torch.load_file(str(path))
    difference = architecture_difference(architecture(state), architecture(net.state_dict()))
    if difference is not None:
        raise ToyError(f"{path}: weights do not match the stored architecture (tensor {difference!r})")
    net.load_state_dict(state, strict=True)
    return net.eval().requires_grad_(False), metadata
