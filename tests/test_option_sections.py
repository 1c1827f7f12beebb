"""The options' sections, bounds and flags: each field belongs to one section and declares its bound and its flag
once, the recipe and the network are what a resumed run keeps, a declared bound is what both TrainingOptions and
train_edm2.py enforce, and a field's flag is train_edm2.py's option, made from the field alone."""

import dataclasses
import json
import math

import click
import pytest
from click.testing import CliRunner

import train_edm2
from cli.network_options import hyperparameter_names
from cli.training_options import field_options
from training.options import BOUNDS, HYPERPARAMETERS, OptionsError, TrainingOptions
from training.sections import (FROM_PRESET, NAMES, NETWORK, RECIPE, REPORTING, SECTIONS, SPEED, SWITCH, Bound, Count,
                               Flag, GridShape, Real, flag_name, flagged_fields, option, out_of_bounds, section_fields)
from tests.helpers import TRAIN_ARGS, assert_one_error_line, toy_tiny_options


def test_every_field_belongs_to_exactly_one_of_the_five_sections():
    names = [f.name for f in dataclasses.fields(TrainingOptions)]
    assert SECTIONS == ("recipe", "network", "speed", "reporting", "paths")
    assert all(f.metadata["section"] in SECTIONS for f in dataclasses.fields(TrainingOptions))
    assert sorted(name for section in SECTIONS for name in section_fields(TrainingOptions, section)) == sorted(names)


def test_a_resumed_run_keeps_the_recipe_and_the_network_and_nothing_else():
    assert HYPERPARAMETERS == (*section_fields(TrainingOptions, RECIPE), *section_fields(TrainingOptions, NETWORK))
    # The hyperparameters runs were made with, so that their training_options.json still resume.
    assert set(HYPERPARAMETERS) == {
        "preset", "cond", "batch", "channels", "dropout", "P_mean", "P_std", "lr", "decay", "rampup_Mimg", "ema_stds",
        "network", "precision", "ls", "seed", "dataset", "init", "label_dropout", "loss_weighting", "noise_dist",
        "uncertainty", "method", "teacher", "tangent_warmup_Mimg", "adam_eps", "text_dropout"}
    assert "encoder" not in HYPERPARAMETERS


def outside(bound: Bound) -> int | float | tuple[int, int]:
    """A value just outside the bound: above its upper end, or below its lower one where it has none."""
    if isinstance(bound, GridShape):
        return bound.high + 1, bound.low
    if isinstance(bound, Count):
        return bound.high + 1
    if math.isfinite(bound.high):
        return bound.high if bound.high_open else bound.high * 2
    return bound.low if bound.low_open else bound.low - 1  # -inf - 1 for a bound of finite numbers alone


def inside(bound: Bound) -> int | float | tuple[int, int]:
    """The bound's largest value: its upper end, or the lower one where it has none."""
    if isinstance(bound, GridShape):
        return bound.high, bound.high
    if isinstance(bound, Count):
        return bound.high
    if math.isfinite(bound.high):
        return math.nextafter(bound.high, -math.inf) if bound.high_open else bound.high
    if math.isfinite(bound.low):
        return math.nextafter(bound.low, math.inf) if bound.low_open else bound.low
    return -1e300


def text(value: int | float | tuple[int, int]) -> str:
    """A value as the command line writes it: a grid's shape as ROWSxCOLS."""
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)


def cli_param(flag: str) -> click.Parameter:
    """train_edm2.py's option of that name."""
    return next(p for p in train_edm2.main.params if flag in p.opts)


@pytest.mark.bad_input
@pytest.mark.parametrize("field", BOUNDS)
def test_a_fields_bound_is_what_the_options_and_the_command_line_enforce(field):
    bound = BOUNDS[field]
    with pytest.raises(OptionsError) as info:
        dataclasses.replace(toy_tiny_options(), **{field: outside(bound)})
    flag, _, rest = str(info.value).partition("=")
    optional = next(f for f in dataclasses.fields(TrainingOptions) if f.name == field).metadata["optional"]
    assert rest.endswith(f": expected {bound.expected()}" + (", or None" if optional else ""))
    assert_one_error_line(CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, f"{flag}={text(outside(bound))}"]),
                          f"'{flag}'")
    assert cli_param(flag).type.convert(text(inside(bound)), None, None) == inside(bound)
    assert bound.admits(inside(bound))


# ---------------------------------------------------------------------------------------------------
# Flags: a field that declares one is a command-line option, made from the field alone (cli.training_options).

# train_edm2.py's options that set no field of the options, or set one from a declaration of their own: --threads
# (cli.speed, shared by every command line) and the network's family and shape (--channels beside them).
# The network families' hyperparameters are declared on their dataclasses (cli.network_options), not as fields.
NOT_FROM_FIELDS = ("--config", "--arch", "--channels", *(f"--{n.replace('_', '-')}" for n in hyperparameter_names()),
                   "--dry-run", "--time-steps", "--threads")


def long_names(command: click.Command) -> list[str]:
    """Every --name of a command's options, as often as it is declared."""
    return [name for p in command.params if isinstance(p, click.Option) for name in p.opts if name.startswith("--")]


def test_train_edm2s_options_are_the_fields_flags_and_the_listed_others():
    flags = [f"--{flag_name(f)}" for f in flagged_fields(TrainingOptions)]
    assert sorted(long_names(train_edm2.main)) == sorted([*flags, *NOT_FROM_FIELDS])
    assert {f.name for f in dataclasses.fields(TrainingOptions) if f.metadata["flag"] is None} == {
        "dataset", "encoder", "network", "channels", "threads"}
    for f in flagged_fields(TrainingOptions):  # each option is its field's: named for it, with the field's help
        param = cli_param(f"--{flag_name(f)}")
        assert param.name == f.name and param.help.startswith(f.metadata["flag"].help)


KINDS = {"a": 1, "b": 2}  # a table whose rows are the choices of Tiny.kind


@dataclasses.dataclass(frozen=True)
class Tiny:
    """Options as a new field would declare them: one field, its flag made from it."""

    width: float = option(RECIPE, Real(0, low_open=True), flag=Flag("Width", name="wide", default=FROM_PRESET))
    depth: int = option(RECIPE, Count(1, 9), default=3, flag=Flag("Blocks per level"))
    scale: float = option(RECIPE, Real(0, low_open=True), default=1.0, flag=Flag("Scale"))
    kind: str = option(RECIPE, default="a", flag=Flag("Kind", choices=KINDS))
    fast: bool = option(SPEED, default=False, flag=Flag("Go fast", form=SWITCH))
    names: tuple[str, ...] = option(REPORTING, default=(), flag=Flag("Names", choices=("x", "y"), form=NAMES,
                                                                       noun="thing", default="none"))
    hidden: int = option(RECIPE, Count(0, 1), default=0)  # no flag: no option


@click.command()
@field_options(Tiny)
def tiny(**values) -> None:
    """A throwaway command of Tiny's options: prints the values it receives."""
    click.echo(json.dumps(values))


def test_a_field_with_a_flag_makes_its_option_with_its_bound_help_and_default():
    lines = [" ".join(line.split()) for line in CliRunner().invoke(tiny, ["--help"]).output.splitlines()]
    options = [line for line in lines if line.startswith("--")]
    assert options == ["--wide FLOAT Width [default: preset] [x>0]",
                       "--depth INTEGER RANGE Blocks per level [default: 3; 1<=x<=9]",
                       "--scale FLOAT Scale [default: 1; x>0]",
                       "--kind [a|b] Kind [default: a]",
                       "--fast Go fast",
                       "--names LIST Names [default: none]",
                       "--help Show this message and exit."]
    result = CliRunner().invoke(tiny, [])
    assert json.loads(result.output) == dict(width=None, depth=3, scale=1.0, kind="a", fast=False, names=None)
    result = CliRunner().invoke(tiny, ["--depth=9", "--wide=0.5", "--fast", "--names=y,x,y"])
    assert json.loads(result.output) == dict(width=0.5, depth=9, scale=1.0, kind="a", fast=True, names=["y", "x"])


@pytest.mark.bad_input
def test_a_fields_option_refuses_what_its_bound_and_choices_refuse():
    assert_one_error_line(CliRunner().invoke(tiny, ["--depth=10"]),
                          "Invalid value for '--depth': 10 is not in the range 1<=x<=9")
    assert_one_error_line(CliRunner().invoke(tiny, ["--wide=0"]), "'--wide'", "x>0")
    assert_one_error_line(CliRunner().invoke(tiny, ["--names=x,z"]), "'--names'", "unknown thing 'z'; choose from x, y")
    assert_one_error_line(CliRunner().invoke(tiny, ["--kind=c"]), "'--kind'")
    # Built in Python, the options refuse the same values by the same declarations, with no rule written for them.
    assert out_of_bounds(Tiny(width=1.0, depth=10), RECIPE) == ("depth", Count(1, 9).expected())
    assert out_of_bounds(Tiny(width=1.0, kind="c"), RECIPE) == ("kind", "one of a, b")
    assert out_of_bounds(Tiny(width=1.0, names=("x", "z")), REPORTING) == ("names", "a tuple of x, y")
    assert out_of_bounds(Tiny(width=1.0, names=["x"]), REPORTING) == ("names", "a tuple of x, y")
    assert [out_of_bounds(Tiny(width=1.0, names=("y", "x")), section) for section in SECTIONS] == [None] * 5


def test_a_row_added_to_a_flags_table_is_a_choice(monkeypatch):
    monkeypatch.setitem(KINDS, "c", 3)
    assert json.loads(CliRunner().invoke(tiny, ["--kind=c"]).output)["kind"] == "c"
    assert out_of_bounds(Tiny(width=1.0, kind="c"), RECIPE) is None


def test_a_flag_refuses_a_form_no_command_line_knows():
    with pytest.raises(ValueError, match="Flag.form='list'"):
        Flag("Names", form="list")
    with pytest.raises(ValueError, match="needs choices"):
        Flag("Names", form=NAMES)
