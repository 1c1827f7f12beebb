"""Blends at their depth: weights whose sum overflows, a blend read through another (its shares composed exactly),
a blend that names itself, and the dry run's line of shares."""

import json
from fractions import Fraction

import numpy as np
import pytest
from click.testing import CliRunner

import dataset_tool
import train_edm2
from edm2.data.blend import MAX_WEIGHT_SUM, BlendDataset, BlendError, blend_sources
from edm2.data.sources import open_data
from training.data_order import order_for
from tests.helpers import TRAIN_ARGS, assert_one_error_line


@pytest.fixture(scope="module")
def zips(tmp_path_factory):
    """Three labeled 20-image ZIPs of one shape: a.zip, x.zip, y.zip."""
    root = tmp_path_factory.mktemp("blends")
    for seed, name in enumerate("axy"):
        result = CliRunner().invoke(dataset_tool.main, ["toy", "--dest", str(root / f"{name}.zip"), "--resolution",
                                                        "8", "--num", "20", "--classes", "4", "--seed", str(seed)])
        assert result.exit_code == 0, result.output
    return root


def dry_run(spec, tmp_path):
    return CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, f"--data={spec}", f"--outdir={tmp_path / 'run'}",
                                                "--dry-run"])


def write_spec(path, *sources):
    path.write_text(json.dumps({"sources": [{"path": str(p), "weight": w} for p, w in sources]}))
    return path


@pytest.mark.bad_input
@pytest.mark.parametrize("weights, total", [((1e308, 1e308, 0), "inf"), ((1e308, 1e307, 0), "1.1e+308")])
def test_weights_whose_sum_overflows_are_one_line_before_training(zips, tmp_path, weights, total):
    spec = ",".join(f"{zips / name}.zip:{w!r}" for name, w in zip("axy", weights))
    assert_one_error_line(dry_run(spec, tmp_path), "--data", f"sum to {total}", f"{MAX_WEIGHT_SUM:.3g}", "scale")
    assert not (tmp_path / "run").exists()


def test_the_largest_weight_sum_admitted_keeps_every_share_finite(zips):
    # MAX_WEIGHT_SUM times a count below 2**63 stays below float's largest: the segments are counts, not NaN.
    assert MAX_WEIGHT_SUM * 2.0**63 <= np.finfo(np.float64).max
    blend = open_data(f"{zips / 'a.zip'}:{MAX_WEIGHT_SUM / 2!r},{zips / 'x.zip'}:{MAX_WEIGHT_SUM / 2!r}")
    assert blend.segments == [20, 20]


def blend_epoch_reads(blend):
    """How many items of each source one blend epoch reads, from the run's data order."""
    order = order_for(blend, seed=0, rank=0, world_size=1, batch_gpu=4, start_nimg=0)
    items = order.indices(np.arange(sum(blend.segments)))
    return np.bincount(np.searchsorted(blend.offsets, items, side="right") - 1, minlength=len(blend.sizes)).tolist()


def test_a_blend_read_through_another_gets_exactly_the_composed_shares(zips, tmp_path):
    # The case: an inner 0.9/0.1 blend at half of an outer one. Of a 60-sample epoch, a.zip's half is 30,
    # and the inner half splits 27 (x) and 3 (y): y gets 10% of the inner blend, 5% of the whole.
    inner = write_spec(tmp_path / "inner.json", (zips / "x.zip", 0.9), (zips / "y.zip", 0.1))
    blend = open_data(f"{zips / 'a.zip'}:1,{inner}:1")
    assert isinstance(blend, BlendDataset) and blend.sizes == [20, 20, 20] and blend.segments == [30, 27, 3]
    assert blend_epoch_reads(blend) == [30, 27, 3]
    assert "y.zip: 5.0% (3 of every 60 samples" in blend.shares()


def test_composed_shares_are_exact_fractions_of_the_weights(zips, tmp_path):
    # Outer 1:3, inner 3:1 (in a JSON spec, with a relative path): 1/4, 3/4 * 3/4 = 9/16, 3/4 * 1/4 = 3/16 exactly;
    # of 60 samples 15, 33.75 and 11.25: the one left over by the floors goes to the largest remainder (x).
    inner = write_spec(tmp_path / "inner.json", (zips / "x.zip", 3), (zips / "y.zip", 1))
    outer = write_spec(tmp_path / "outer.json", (zips / "a.zip", 1), (inner.name, 3))
    assert [w for _, w in blend_sources(str(outer))] == [Fraction(1, 4), Fraction(9, 16), Fraction(3, 16)]
    blend = open_data(outer)
    assert blend.segments == [15, 34, 11] and blend_epoch_reads(blend) == [15, 34, 11]


def test_a_blend_without_blends_keeps_its_weights_as_given(zips):
    pairs = blend_sources(f"{zips / 'a.zip'}:0.7,{zips / 'x.zip'}:0.1")
    assert pairs == [(str(zips / "a.zip"), 0.7), (str(zips / "x.zip"), 0.1)]


@pytest.mark.bad_input
def test_a_blend_that_names_itself_is_refused_naming_the_cycle(zips, tmp_path):
    own = tmp_path / "own.json"
    write_spec(own, (zips / "a.zip", 1), (own, 1))
    assert_one_error_line(dry_run(own, tmp_path), "--data", f"{own} names itself ({own} -> {own})")
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    write_spec(first, (zips / "a.zip", 1), (second, 1))
    write_spec(second, (zips / "x.zip", 1), (first.name, 1))  # relative to second.json: the same file
    assert_one_error_line(dry_run(f"{zips / 'y.zip'}:1,{first}:1", tmp_path), "--data",
                          f"{first} names itself ({first} -> {second} -> {tmp_path / first.name})")
    assert not (tmp_path / "run").exists()
    with pytest.raises(BlendError, match="names itself"):
        blend_sources(str(second))


def test_the_dry_run_prints_a_blends_shares_as_the_start_does(zips, tmp_path):
    result = dry_run(f"{zips / 'a.zip'}:3,{zips / 'x.zip'}:1", tmp_path)
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stderr.splitlines() if line.startswith("Blend of 2 datasets"))
    assert line == open_data(f"{zips / 'a.zip'}:3,{zips / 'x.zip'}:1").describe()
    assert "a.zip: 75.0% (30 of every 40 samples, 20 in the source)" in line and "x.zip: 25.0% (10 of every 40" in line
