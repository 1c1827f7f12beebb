"""Network families: the one place that says which networks the EDM preconditioning can hold.

`edm2.networks.Precond` wraps a network F(x; c_noise, labels) in the preconditioning of Eq. 4-8. Which network is
a *family*: a NetworkFamily record registered here under a name. A snapshot records the family in its
constructor arguments (network_kwargs['family']; a snapshot without it, written before families existed, is of
the release's family 'edm2'), and everything that builds, probes or counts a network asks the registry:
`Precond`, `load_network`, the release-pickle importer (family 'edm2'), the magnitude probe and FLOP counts
(`NetworkFamily.blocks`), `train_edm2.py --arch` and its options (`NetworkFamily.hyperparameters`), `generate.py` and
`count_flops.py`.

A family's record:

- name: what a snapshot records and `train_edm2.py --arch` takes.
- constructor: `constructor(img_resolution, img_channels, label_dim, model_channels=..., dropout=..., **arguments)`
  builds F, a torch.nn.Module whose forward(x, noise_labels, class_labels) returns a tensor shaped like x
  (class_labels is None when label_dim is 0). It checks its arguments before allocating anything, raising
  edm2.layers.ArchitectureError (they may come from a file), and its arguments are JSON values.
- blocks: `blocks(F)` lists F's blocks as (name, module) in evaluation order: the magnitude probe reads their
  outputs (paper Figure 3) and FLOP counts report each one.
- hyperparameters: a dataclass whose fields are the constructor arguments that a run chooses, each made with
  edm2.network_args.hyperparameter(default, bound, help): train_edm2.py has an option of each field's name
  (`depth` -> `--depth`) with its bound and help, a preset gives some of them, and those of another family's
  dataclass are refused for this one. The U-Net's are network_args.TextUNetHyperparameters.
- summary: one line for `train_edm2.py --help` and error messages.

A new family is its own module that ends with `register(NetworkFamily(...))`, and one import line in
edm2/architectures/__init__.py, which imports every family so that any snapshot's family is known (see
docs/extending.md). The release's U-Net registers as 'edm2' in edm2/networks.py.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from edm2.layers import ArchitectureError
from edm2.network_args import check_hyperparameters, hyperparameter_fields

DEFAULT_FAMILY = "edm2"  # the release's U-Net (config G); snapshots without a family record are of it


class UnknownFamily(ArchitectureError):
    """A family name that no registered NetworkFamily has; the message names it and the registered ones."""


@dataclasses.dataclass(frozen=True)
class NoHyperparameters:
    """The hyperparameters of a family that has none a run chooses."""


@dataclasses.dataclass(frozen=True)
class NetworkFamily:
    """A kind of network F that Precond can hold: its name, constructor, blocks and hyperparameters."""

    name: str
    constructor: Callable[..., torch.nn.Module]
    blocks: Callable[[torch.nn.Module], list[tuple[str, torch.nn.Module]]]
    hyperparameters: type = NoHyperparameters
    summary: str = ""

    def fields(self) -> dict[str, dataclasses.Field]:
        """The family's hyperparameters by name, in their order: defaults, bounds and help in their metadata."""
        return hyperparameter_fields(self.hyperparameters)

    def check(self, values: dict) -> None:
        """Raise ArchitectureError unless every value is one of the family's hyperparameters within its bound."""
        check_hyperparameters(self.hyperparameters, values)


_REGISTRY: dict[str, NetworkFamily] = {}


def register(family: NetworkFamily) -> NetworkFamily:
    """Add a family under its name and return it; a name is registered once (a second record would be ambiguous)."""
    if not family.name or not isinstance(family.name, str):
        raise ArchitectureError(f"a network family needs a name, not {family.name!r}")
    hyperparameters = family.hyperparameters
    if not (isinstance(hyperparameters, type) and dataclasses.is_dataclass(hyperparameters)) or any(
            "bound" not in f.metadata for f in dataclasses.fields(hyperparameters)):
        raise ArchitectureError(f"network family {family.name!r}: its hyperparameters must be a dataclass of "
                                "edm2.network_args.hyperparameter fields")
    known = _REGISTRY.get(family.name)
    if known is not None and known != family:
        raise ArchitectureError(f"network family {family.name!r} is already registered")
    _REGISTRY[family.name] = family
    return family


def get(name: object) -> NetworkFamily:
    """The family registered under name; UnknownFamily (one line naming it and the known ones) if none is."""
    family = _REGISTRY.get(name) if isinstance(name, str) else None
    if family is None:
        shown = repr(name) if isinstance(name, str) and len(name) <= 60 else f"<a {type(name).__name__}>"
        raise UnknownFamily(f"unknown network family {shown}: this edm2 knows {', '.join(names())}")
    return family


def names() -> list[str]:
    """The registered family names, sorted."""
    return sorted(_REGISTRY)


def family_of(network_kwargs: dict) -> NetworkFamily:
    """The family that stored constructor arguments name; DEFAULT_FAMILY for those that name none."""
    return get(network_kwargs.get("family", DEFAULT_FAMILY))
