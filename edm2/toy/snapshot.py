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
from edm2.toy.consistency import ToyFlow
from edm2.toy.gmm import ToyError
from edm2.toy.model import ToyDenoiser

METADATA_KEY = "edm2-toy"
# The metadata's 'network' names the kind; files written before consistency models have none and hold a denoiser.
NETWORKS = {"ToyDenoiser": ToyDenoiser, "ToyFlow": ToyFlow}


def save_toy(path: str | os.PathLike, net: ToyDenoiser | ToyFlow, metadata: dict) -> None:
    """Write the network's float32 weights, its kind and metadata atomically to a .safetensors file; a ToyFlow's
    metadata holds its 'consistency' record."""
    save_network(path, net, dict(metadata, network=type(net).__name__), METADATA_KEY, torch.float32)


def load_release_toy_pickle(path: str | os.PathLike) -> ToyDenoiser:
    """Our ToyDenoiser (eval mode, float32) from one of the release's toy-example snapshots (toy_example.py's
    iterNNNN.pkl: a pickled ToyModel), without running its code."""
    record = restricted_load(path)
    with reading(path):
        model = expect_record(record, ("ToyModel",), "toy example snapshot")
        return rebuild_module(model, ToyDenoiser, "the toy model")


def network_class(path: str | os.PathLike, metadata: dict) -> type[ToyDenoiser] | type[ToyFlow]:
    """The network a toy snapshot's metadata declares; ToyError for an unknown kind, or a consistency record on a
    denoiser (or none on a consistency model)."""
    kind = metadata.get("network", "ToyDenoiser")
    if not isinstance(kind, str) or kind not in NETWORKS:
        raise ToyError(f"{path}: unknown toy network {kind!r}; expected one of {', '.join(NETWORKS)}")
    if (kind == "ToyFlow") != ("consistency" in metadata):
        raise ToyError(f"{path}: a {kind} snapshot {'without' if kind == 'ToyFlow' else 'with'} consistency metadata")
    return NETWORKS[kind]


def load_toy(path_or_url: str | os.PathLike) -> tuple[ToyDenoiser | ToyFlow, dict]:
    """(network in eval mode, metadata) from our .safetensors toy snapshot (a denoiser or a consistency model) or
    the release's toy .pkl (path or URL)."""
    path = files.cached_path(path_or_url)
    check_readable(path)
    if path.suffix == ".pkl":
        return load_release_toy_pickle(path), {"source": "release-pickle"}
    metadata = read_metadata(path, METADATA_KEY, "a toy-example snapshot")
    network = network_class(path, metadata)
    try:
        # On 'meta': arguments declaring a larger network than the file's weights allocate nothing before
        # load_weights refuses them.
        with torch.device("meta"):
            net = network(**metadata.get("network_kwargs", {}))
    except Exception as e:  # arguments from a file can fail in any way (TypeError, ValueError, RuntimeError...)
        raise ToyError(f"{path}: unsupported toy network arguments: {one_line(e)}") from None
    load_weights(path, net)
    return net.eval().requires_grad_(False), metadata
