"""The options' sections and bounds: each field belongs to one section and declares its bound once, the recipe and
the network are what a resumed run keeps, and a declared bound is what both TrainingOptions and train_edm2.py
enforce."""

import dataclasses
import math

import click
import pytest
from click.testing import CliRunner

import train_edm2
from training.options import BOUNDS, HYPERPARAMETERS, OptionsError, TrainingOptions
from training.sections import NETWORK, RECIPE, SECTIONS, Bound, Count, GridShape, section_fields
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
        "uncertainty"}
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
