"""train_edm2.py's network options, made from the registered families' hyperparameters (edm2.families): one option
per hyperparameter name (`depth` -> --depth), its type from the bounds the families declare, its help the field's
with the families that take it. A family added to edm2.architectures brings its options with it."""

from __future__ import annotations

from typing import Callable

import click

import edm2.architectures  # noqa: F401  (every family, so that each brings its options)
from cli.types import Integer, IntList
from edm2 import families
from edm2.network_args import ChoiceBound, IntegerBound, IntegersBound


def declared() -> dict[str, list[families.NetworkFamily]]:
    """Each hyperparameter name of the registered families, with the families that declare it (sorted by name)."""
    owners: dict[str, list[families.NetworkFamily]] = {}
    for name in families.names():
        family = families.get(name)
        for field in family.fields():
            owners.setdefault(field, []).append(family)
    return owners


def hyperparameter_names() -> tuple[str, ...]:
    """The names of the network options: every registered family's hyperparameters."""
    return tuple(declared())


def option_type(name: str, owners: list[families.NetworkFamily]) -> click.ParamType:
    """The type of the option `name`: what every family that declares it admits (the families' own bounds refuse
    the rest, in training.architecture.network_options)."""
    bounds = [family.fields()[name].metadata["bound"] for family in owners]
    if all(type(b) is ChoiceBound for b in bounds):
        return click.Choice(sorted({choice for b in bounds for choice in b.choices}))
    low, high = min(b.low for b in bounds), max(b.high for b in bounds)
    if all(type(b) is IntegerBound for b in bounds):
        return Integer(low, high)
    if all(type(b) is IntegersBound for b in bounds):
        return IntList(low, high, allow_empty=min(b.min_len for b in bounds) == 0)
    raise families.ArchitectureError(f"the network families {', '.join(f.name for f in owners)} declare {name} as "
                                     "different kinds of values: give one of them another name")


def shown_default(value: object) -> str:
    """A hyperparameter's default as the command line spells it: lists comma-separated, 'none' for the empty one."""
    return (",".join(map(str, value)) or "none") if isinstance(value, (list, tuple)) else str(value)


def hyperparameter_options(command: Callable) -> Callable:
    """Add an option per hyperparameter name to a click command, None unless given (the preset's value, else the
    family's default); the command receives them by name."""
    for name, owners in reversed(declared().items()):
        fields = [family.fields()[name] for family in owners]
        defaults = {shown_default(field.default) for field in fields}
        default = defaults.pop() if len(defaults) == 1 else "the family's"
        command = click.option(f"--{name.replace('_', '-')}", name, type=option_type(name, owners),
                               help=f"{fields[0].metadata['help']}; network families "
                                    f"{', '.join(family.name for family in owners)}  [default: preset, else "
                                    f"{default}]")(command)
    return command


def given_hyperparameters(values: dict) -> dict:
    """Take the network options out of a command's keyword arguments: name -> value, None where not given."""
    return {name: values.pop(name) for name in hyperparameter_names()}
