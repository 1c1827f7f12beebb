"""The sections of a run's options, the bounds of their fields and their command-line flags, each declared once,
on the field.

Every field of training.options.TrainingOptions names its section (recipe, network, speed, reporting, paths),
where it has one the bound of its values, and where the command line sets it its flag (Flag: help, spelling,
form, choices). The options check the bounds and choices when built, and train_edm2.py's options are made from
the same fields (cli.training_options), so no option, number, name or help text is written twice. Nothing here
knows click.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from edm2.formats.snapshot import MAX_NIMG

# What is trained and the network it is trained as: together what a resumed run must keep.
RECIPE, NETWORK = "recipe", "network"
# How fast, what is reported and for how long, and where: a resumed run may change these.
SPEED, REPORTING, PATHS = "speed", "reporting", "paths"
SECTIONS = (RECIPE, NETWORK, SPEED, REPORTING, PATHS)


@dataclasses.dataclass(frozen=True)
class Count:
    """An integer (bool is none) from low to high."""

    low: int
    high: int

    def admits(self, value: object) -> bool:
        """Whether value lies within the bound."""
        return type(value) is int and self.low <= value <= self.high

    def expected(self) -> str:
        """What the bound admits, as a message says it."""
        return f"an integer from {self.low} to {self.high}"


@dataclasses.dataclass(frozen=True)
class Images(Count):
    """An image count from low to below 2**53 (edm2.formats.snapshot.MAX_NIMG); the command line takes 8Mi too."""

    high: int = MAX_NIMG - 1

    def expected(self) -> str:
        """What the bound admits, as a message says it."""
        return f"an image count from {self.low} to 2**53 - 1"


@dataclasses.dataclass(frozen=True)
class Real:
    """A finite number (an int or a float) from low to high; either end may be open, or infinite."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def admits(self, value: object) -> bool:
        """Whether value lies within the bound (NaN and infinities never do)."""
        # An int compares exactly, however long; converting one of 400 digits to float would raise OverflowError.
        if not (type(value) is int or (type(value) is float and math.isfinite(value))):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def expected(self) -> str:
        """What the bound admits, as a message says it."""
        if math.isfinite(self.high):
            return f"a number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}" \
                   f"{')' if self.high_open else ']'}"
        if math.isfinite(self.low):
            return f"a number {'>' if self.low_open else '>='} {self.low:g}"
        return "a finite number"


@dataclasses.dataclass(frozen=True)
class GridShape:
    """The shape of an image grid: (rows, cols), each an integer from low to high, or () for none."""

    low: int
    high: int

    def admits(self, value: object) -> bool:
        """Whether value is () or a pair within the bound."""
        return isinstance(value, tuple) and (value == () or len(value) == 2 and all(
            type(n) is int and self.low <= n <= self.high for n in value))

    def expected(self) -> str:
        """What the bound admits, as a message says it."""
        return f"(rows, cols) of {self.low} to {self.high} each, or () for none"


Bound = Count | Real | GridShape

# How a flag takes its value (Flag.form): --name=VALUE; --name alone for True; --name/--no-name (True, False, or
# neither: None); --name=A --name=B, each one of the choices; --name=A,B of the choices; --name=0.05,0.1 of sigma_rel
# values, where 'a,b,...,c' is the evenly spaced range.
VALUE, SWITCH, PAIR, REPEATED, NAMES, SIGMA_RELS = "value", "switch", "pair", "repeated", "names", "sigma-rels"
FORMS = (VALUE, SWITCH, PAIR, REPEATED, NAMES, SIGMA_RELS)
FROM_PRESET = "preset"  # Flag.default of the recipe's fields that the preset gives unless the command line does


@dataclasses.dataclass(frozen=True)
class Flag:
    """How the command line sets a field: the help text and, where the field alone does not say them, the flag's
    spelling, its value's form and what gives the value when the flag is absent. A value's type and range come
    from the field's bound; a flag's default is the field's, unless `default` names what gives it instead (the
    preset, the data), when the flag's own is None."""

    help: str
    name: str | None = None  # the flag's spelling, where it is not the field's name with dashes
    metavar: str | None = None  # where the value's type names none (a path, a list)
    choices: Mapping | tuple[str, ...] | None = None  # a table's names as they are when a command line parses
    form: str = VALUE  # one of FORMS
    default: str | None = None  # --help's '[default: ...]' where the flag's own default is None
    noun: str = "name"  # NAMES: what one of the choices is called where an unknown one is refused
    envvar: str | None = None  # an environment variable read where the flag is absent
    required: bool = False

    def __post_init__(self) -> None:
        """Refuse a form no command line knows, and a form of names without the names."""
        if self.form not in FORMS:
            raise ValueError(f"Flag.form={self.form!r}: expected one of {', '.join(FORMS)}")
        if self.form in (REPEATED, NAMES) and self.choices is None:
            raise ValueError(f"Flag.form={self.form!r} needs choices")


def option(section: str, bound: Bound | None = None, *, optional: bool = False, flag: Flag | None = None,
           **field) -> dataclasses.Field:
    """A field of the options: its section, the bound of its values (None too, where optional), its flag where the
    command line sets it from the field, and dataclasses.field's arguments (default=...)."""
    return dataclasses.field(metadata=dict(section=section, bound=bound, optional=optional, flag=flag), **field)


def flag_name(field: dataclasses.Field) -> str:
    """The field's flag as the command line spells it, without dashes: Flag.name, or the name with dashes."""
    flag = field.metadata.get("flag")
    return flag.name if flag is not None and flag.name is not None else field.name.replace("_", "-")


def flagged_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    """The fields of a dataclass that declare a flag, in their order."""
    return tuple(f for f in dataclasses.fields(cls) if f.metadata.get("flag") is not None)


def section_fields(cls: type, section: str) -> tuple[str, ...]:
    """The names of a dataclass's fields in one section, in their order."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("section") == section)


def bounds(cls: type) -> dict[str, Bound]:
    """Each bounded field's name and bound."""
    return {f.name: f.metadata["bound"] for f in dataclasses.fields(cls) if f.metadata.get("bound") is not None}


def out_of_bounds(opts: object, section: str) -> tuple[str, str] | None:
    """The first field of the section whose value its bound or its flag's choices refuse, and what it expects; None
    if there is none."""
    for f in dataclasses.fields(opts):
        bound, value, optional = f.metadata.get("bound"), getattr(opts, f.name), f.metadata.get("optional")
        if f.metadata.get("section") != section or optional and value is None:
            continue
        if bound is not None and not bound.admits(value):
            return f.name, bound.expected() + (", or None" if optional else "")
        refused = _refused_choice(f.metadata.get("flag"), value)
        if refused is not None:
            return f.name, refused
    return None


def _refused_choice(flag: Flag | None, value: object) -> str | None:
    """What a flag's choices expect, if value is none of them (a tuple of them, for the forms of several); None if
    the flag has no choices or they admit value."""
    if flag is None or flag.choices is None:
        return None
    names = ", ".join(flag.choices)
    if flag.form in (REPEATED, NAMES):
        ok = isinstance(value, tuple) and all(isinstance(name, str) and name in flag.choices for name in value)
        return None if ok else f"a tuple of {names}"
    return None if isinstance(value, str) and value in flag.choices else f"one of {names}"
