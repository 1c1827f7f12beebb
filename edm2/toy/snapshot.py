"""Toy-example snapshot files: the denoiser's safetensors weights plus JSON metadata; the release's toy pickles
(pickled ToyModels) through edm2.formats.release_pickle's restricted importer.

The metadata sits under its own key ('edm2-toy'), so an EDM2 command given a toy file, or the toy example given an
EDM2 snapshot, refuses it in one line.
"""

from __future__ import annotations

import os

import torch

from edm2.errors import one_line
from edm2.formats.release_pickle import expect_record, reading, rebuild_module, restricted_load
from edm2.formats.snapshot import check_readable, load_weights, read_metadata, save_network
from edm2.runtime import files
from edm2.toy.gmm import ToyError
from edm2.toy.model import ToyDenoiser

METADATA_KEY = "edm2-toy"


def save_toy(path: str | os.PathLike, net: ToyDenoiser, metadata: dict) -> None:
    """Write the denoiser's float32 weights and metadata atomically to a .safetensors file."""
    save_network(path, net, metadata, METADATA_KEY, torch.float32)


def load_release_toy_pickle(path: str | os.PathLike) -> ToyDenoiser:
    """Our ToyDenoiser (eval mode, float32) from one of the release's toy-example snapshots (toy_example.py's
    iterNNNN.pkl: a pickled ToyModel), without running its code."""
    record = restricted_load(path)
    with reading(path):
        model = expect_record(record, ("ToyModel",), "toy example snapshot")
        return rebuild_module(model, ToyDenoiser, "the toy model")


def load_toy(path_or_url: str | os.PathLike) -> tuple[ToyDenoiser, dict]:
    """(denoiser in eval mode, metadata) from our .safetensors toy snapshot or the release's toy .pkl (path or URL)."""
    path = files.cached_path(path_or_url)
    check_readable(path)
    if path.suffix == ".pkl":
        return load_release_toy_pickle(path), {"source": "release-pickle"}
    metadata = read_metadata(path, METADATA_KEY, "a toy-example snapshot")
    try:
        # On 'meta': arguments declaring a larger network than the file's weights allocate nothing before
        # load_weights refuses them.
        with torch.device("meta"):
            net = ToyDenoiser(**metadata.get("network_kwargs", {}))
    except Exception as e:  # arguments from a file can fail in any way (TypeError, ValueError, RuntimeError...)
        raise ToyError(f"{path}: unsupported toy network arguments: {one_line(e)}") from None
    load_weights(path, net)
    return net.eval().requires_grad_(False), metadata
