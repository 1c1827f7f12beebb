"""The learning-rate schedule against paper Eq. 67 with the release's linear ramp-up."""

import math

import pytest

from training.lr_schedule import learning_rate_schedule


@pytest.mark.parametrize(
    "cur_nimg, want",
    [
        (0, 0.0),  # the ramp-up starts from zero
        (2_500_000, 0.0100 * 0.25),  # t = 1220.7 < t_ref: alpha_ref, ramp-up 1/4
        (10_000_000, 0.0100),  # ramp-up complete, t = 4882.8 < t_ref
        (70_000 * 2048, 0.0100),  # t = t_ref exactly
        (280_000 * 2048, 0.0100 / 2),  # t = 4 t_ref
        (1_000_000 * 2048, 0.0100 / math.sqrt(1_000_000 / 70_000)),
    ],
)
def test_learning_rate_is_eq67_with_rampup(cur_nimg, want):
    got = learning_rate_schedule(cur_nimg, batch=2048, lr=0.0100, decay=70_000, rampup_Mimg=10)
    # Python floats (IEEE float64, the same on every machine): three or four operations, each within half an ulp.
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_learning_rate_without_decay_or_rampup():
    assert learning_rate_schedule(10**9, 2048, lr=0.01, decay=0, rampup_Mimg=0) == 0.01
    assert learning_rate_schedule(64 * 35_000 * 9, 64, lr=0.009, decay=35_000, rampup_Mimg=0) == pytest.approx(0.003)
