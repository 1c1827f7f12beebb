"""The click options of a dataclass's flagged fields (training.sections.Flag): train_edm2.py's options are
TrainingOptions' fields, so an option is declared once, on its field, with its bound, help and default."""

from __future__ import annotations

import dataclasses
from typing import Callable, TypeVar

import click

from cli.types import NameList, StdList, TableChoice, bound_type
from training.sections import NAMES, PAIR, REPEATED, SIGMA_RELS, SWITCH, flag_name, flagged_fields

F = TypeVar("F", bound=Callable)


def default_text(value: object) -> str:
    """A field's default as the command line writes it, which --help shows: 1.0 as 1, 0.0 as 0."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def value_type(field: dataclasses.Field) -> click.ParamType | None:
    """The type of the field's value on the command line: from its bound, its choices or its form (None: text)."""
    flag, bound = field.metadata["flag"], field.metadata["bound"]
    if flag.form == SIGMA_RELS:
        return StdList()
    if flag.form == NAMES:
        return NameList(flag.choices, flag.noun)
    if bound is not None:
        return bound_type(bound)
    if flag.choices is not None:
        return TableChoice(flag.choices)
    return click.BOOL if field.type in (bool, "bool") else None  # "bool" under `from __future__ import annotations`


def field_option(field: dataclasses.Field) -> Callable[[F], F]:
    """The click option of one flagged field: parameter name the field's, so a command receives the fields' values
    by name (None where the flag is absent and its Flag.default names what gives the value)."""
    flag = field.metadata["flag"]
    name = f"--{flag_name(field)}"
    settings = dict(help=flag.help, metavar=flag.metavar, envvar=flag.envvar, required=flag.required)
    if flag.form == SWITCH:
        settings.update(is_flag=True)
    elif flag.form == PAIR:
        name = f"{name}/--no-{flag_name(field)}"
    else:
        settings.update(type=value_type(field), multiple=flag.form == REPEATED)
    if flag.default is not None:
        settings.update(help=f"{flag.help}  [default: {flag.default}]", default=None)
    elif field.default is not dataclasses.MISSING and field.default is not None:
        switch = flag.form in (SWITCH, PAIR)  # a switch's default is which way it stands, not a value to show
        settings.update(default=field.default if switch else default_text(field.default), show_default=not switch)
    return click.option(name, field.name, **settings)


def field_options(cls: type) -> Callable[[F], F]:
    """A decorator giving a command the options of cls's flagged fields, listed by --help in the fields' order."""
    options = [field_option(f) for f in flagged_fields(cls)]

    def decorate(command: F) -> F:
        """command with the fields' options."""
        for option in reversed(options):
            command = option(command)
        return command

    return decorate
