"""sCM's equations on a real (tiny, randomized) EDM2 network, each against an independent computation: the
EDM<->TrigFlow conversion, sCT's tangent, the student's jvp in training mode (float32, and bf16 with the
rearrangement) against float64 central differences of the same dropout masks, Algorithm 1's loss written out by hand,
and the 1- and 2-step samplers written out."""

import copy
import math

import pytest
import torch

from edm2.consistency import algorithm1_loss, denoiser_velocity, noised, rearranged_jvp, sct_tangent
from edm2.consistency_sampler import (RHO, SIGMA_MIN, check_cm_settings, cm_times, consistency_sample,
                                      is_consistency_model)
from edm2.layers import force_weight_normalization
from edm2.sampler import SamplerError
from edm2.trigflow import adaptive_logvar, consistency_model, edm_denoiser
from tests.helpers import randomized, tiny_precond

SIGMA_DATA = 0.5
LABELS = torch.eye(10)[[3, 8]]


def network(dtype=torch.float64, train=False, dropout=0.0, **overrides):
    """A tiny randomized Precond (its stored weights normalized, Eq. 66, as a trained one's are)."""
    net = randomized(tiny_precond(dropout=dropout, **overrides)).to(dtype).train(train)
    force_weight_normalization(net)
    return net


def draw(dtype=torch.float64, seed=0):
    """(x0, z, t): data, noise of standard deviation sigma_d and times in (0, pi/2) for 2 images."""
    generator = torch.Generator().manual_seed(seed)
    x0 = torch.randn([2, 3, 8, 8], generator=generator, dtype=torch.float64) * SIGMA_DATA
    z = torch.randn([2, 3, 8, 8], generator=generator, dtype=torch.float64) * SIGMA_DATA
    t = torch.tensor([0.4, 1.2], dtype=torch.float64)
    return x0.to(dtype), z.to(dtype), t.to(dtype)


def by_time(t, x):
    """t [N] broadcast against x [N, ...], written out here rather than taken from the code under test."""
    return t.reshape(-1, 1, 1, 1)


def seeded(fn, seed):
    """fn() with torch's generator reseeded first: dropout draws the same masks on every call."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


def path_derivative(F, x0, z, t, seed, h=1e-5):
    """d/dt F(x_t / sigma_d, t) along x_t = cos t x0 + sin t z, by float64 central differences of the same masks."""
    def at(s):
        x = torch.cos(by_time(s, x0)) * x0 + torch.sin(by_time(s, x0)) * z
        return seeded(lambda: F(x / SIGMA_DATA, s), seed)
    return (at(t + h) - at(t - h)) / (2 * h)


@pytest.mark.parametrize("time_embedding", ["edm", "trigflow"])
def test_an_edm2_network_seen_in_trigflow_is_the_same_denoiser(time_embedding):
    net = network(time_embedding=time_embedding)
    x0, z, t = draw()
    x_t = torch.cos(by_time(t, x0)) * x0 + torch.sin(by_time(t, x0)) * z
    F = consistency_model(net, LABELS)
    with torch.no_grad():
        f = torch.cos(by_time(t, x0)) * x_t - torch.sin(by_time(t, x0)) * SIGMA_DATA * F(x_t / SIGMA_DATA, t)
        edm = net(x_t / torch.cos(by_time(t, x0)), SIGMA_DATA * torch.tan(t), LABELS)
        # The network's output is of order one, float64 round-off 1e-16 per operation.
        torch.testing.assert_close(f, edm, rtol=0, atol=1e-12)
        # The teacher's velocity dx_t/dt of the PF-ODE is sigma_d F: the network's own F.
        velocity = denoiser_velocity(edm_denoiser(net, LABELS), x_t, t, SIGMA_DATA)
        torch.testing.assert_close(velocity, SIGMA_DATA * F(x_t / SIGMA_DATA, t), rtol=0, atol=1e-12)
    assert f.abs().max() > 0.1  # a randomized network's output is no trivial zero


def test_the_sct_tangent_is_the_time_derivative_of_the_noised_sample():
    x0, z, t = draw()
    h = 1e-5
    # Central differences err by O(h^2) = 1e-10 (derivatives of cos and sin are bounded by one) plus 1e-11 round-off.
    finite = (noised(x0, z, t + h) - noised(x0, z, t - h)) / (2 * h)
    torch.testing.assert_close(sct_tangent(x0, z, t), finite, rtol=0, atol=1e-8)


def jvp_check(net, dtype, seed=7):
    """(rearranged jvp of the student in `dtype`, float64 central differences times cos t sin t): same masks."""
    x0, z, t = draw()
    reference = copy.deepcopy(net).double()
    reference.cpu_16bit = False
    expected = torch.cos(by_time(t, x0)) * torch.sin(by_time(t, x0)) * path_derivative(
        consistency_model(reference, LABELS), x0, z, t, seed)
    with torch.no_grad():
        F_minus, derivative = seeded(lambda: rearranged_jvp(
            consistency_model(net, LABELS), noised(x0, z, t).to(dtype), t.to(dtype), sct_tangent(x0, z, t).to(dtype),
            SIGMA_DATA), seed)
        F_ref = consistency_model(reference, LABELS)
        F_expected = seeded(lambda: F_ref(noised(x0, z, t) / SIGMA_DATA, t), seed)
        # Dropout is on: other masks change F at order one, far beyond any round-off.
        assert rms(seeded(lambda: F_ref(noised(x0, z, t) / SIGMA_DATA, t), seed + 1) - F_expected) > 0.1 * rms(F_expected)
    return F_minus.double(), derivative.double(), F_expected, expected


def rms(x):
    return x.square().mean().sqrt().item()


# The release's network, and an sCM student's: TrigFlow time embedding, double-norm modulation, guidance embedding.
STUDENTS = {"release": {}, "scm": dict(time_embedding="trigflow", modulation="double-norm", guidance_embedding=True)}


@pytest.mark.parametrize("switches", STUDENTS.values(), ids=STUDENTS.keys())
def test_the_students_jvp_in_training_mode_equals_finite_differences_in_float32(switches):
    net = network(torch.float32, train=True, dropout=0.3, **switches)
    F_minus, derivative, F_expected, expected = jvp_check(net, torch.float32)
    # float32 round-off (2^-24 relative) over a network of some tens of operations: 1e-5 of the values' scale.
    scale = rms(expected)
    torch.testing.assert_close(F_minus, F_expected, rtol=0, atol=1e-5 * rms(F_expected))
    torch.testing.assert_close(derivative, expected, rtol=0, atol=1e-4 * scale)


def test_the_rearranged_jvp_in_bf16_equals_finite_differences():
    net = network(torch.float32, train=True, dropout=0.3, use_bf16=True)
    net.cpu_16bit = True  # compute in bf16 on this CPU, as on CUDA
    F_minus, derivative, F_expected, expected = jvp_check(net, torch.float32)
    # bf16 keeps 8 significant bits: each rounding errs by up to 2^-9 relatively, and the errors of the network's
    # some tens of roundings add up at random to a few times that; 2^-4 of the RMS leaves room, while a wrong sign or
    # factor errs by the RMS itself.
    bf16 = 2.0 ** -8
    assert rms(F_minus - F_expected) < 16 * bf16 * rms(F_expected)
    assert rms(derivative - expected) < 16 * bf16 * rms(expected)
    # ...and the float32 network's jvp differs from bf16's by bf16's round-off: the 16-bit path was taken.
    net.cpu_16bit = False
    assert rms(jvp_check(net, torch.float32)[1] - derivative) > 1e-4 * rms(expected)


def tangents_near_zero(net, times=(1e-2, 1e-3, 1e-4)):
    """RMS of the rearranged tangent cos t sin t dF/dt and of the plain dF/dt, at each time (float64)."""
    x0, z, _ = draw()
    scaled, plain = [], []
    for t0 in times:
        t = torch.full([2], t0, dtype=torch.float64)
        _, derivative = rearranged_jvp(consistency_model(net, LABELS), noised(x0, z, t), t, sct_tangent(x0, z, t),
                                       SIGMA_DATA)
        scaled.append(rms(derivative))
        plain.append(rms(derivative / (math.cos(t0) * math.sin(t0))))
    return scaled, plain


def test_the_rearranged_tangent_stays_of_order_one_as_t_goes_to_zero():
    # EDM's time embedding ln(sigma_d tan t) / 4 changes like 1 / (4 t) near t = 0: the plain dF/dt grows like 1 / t.
    scaled, plain = tangents_near_zero(network(torch.float64))
    assert max(scaled) < 1.5 * min(scaled) and max(scaled) < 100
    for a, b in zip(plain, plain[1:]):
        assert 7 < b / a < 13  # t ten times smaller, dF/dt ten times larger
    # With TrigFlow's time embedding c_noise = t, dF/dt itself stays bounded there.
    _, plain = tangents_near_zero(network(torch.float64, time_embedding="trigflow"))
    assert max(plain) < 1.5 * min(plain)


@pytest.mark.parametrize("r", [0.0, 1.0])
def test_algorithm1_loss_equals_algorithm1_by_hand(r):
    net = network(torch.float64, train=True, dropout=0.2)
    x0, z, t = draw()
    seed, c = 11, 0.1
    F = consistency_model(net, LABELS)
    loss, norm = algorithm1_loss(F, adaptive_logvar(net), x0, z, t, sct_tangent(x0, z, t), r, SIGMA_DATA, seed)
    # Algorithm 1 by hand, in float64: x_t, dx_t/dt, F-, dF-/dt by central differences of the same masks, g, the
    # normalization, the weight w(t) / e^u(t) with the prior 1 / (sigma_d tan t).
    cos, sin = torch.cos(by_time(t, x0)), torch.sin(by_time(t, x0))
    x_t, dxdt = cos * x0 + sin * z, cos * z - sin * x0
    with torch.no_grad():
        F_minus = seeded(lambda: F(x_t / SIGMA_DATA, t), seed)
        dFdt = path_derivative(F, x0, z, t, seed)
        g = -cos**2 * (SIGMA_DATA * F_minus - dxdt) - r * cos * sin * (x_t + SIGMA_DATA * dFdt)
        g_norm = g.square().mean(dim=[1, 2, 3]).sqrt()
        g_hat = g / (by_time(g_norm, g) + c)
        u = net.logvar(SIGMA_DATA * torch.tan(t))
        weight = 1 / (SIGMA_DATA * torch.tan(t))
        expected = by_time(weight / torch.exp(u), g) * (F_minus - F_minus - g_hat) ** 2 + by_time(u, g)
    # dF/dt by central differences errs by ~1e-9 relatively; it enters g at r = 1 only.
    torch.testing.assert_close(norm, g_norm, rtol=1e-7, atol=0)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-7, atol=1e-9)
    assert loss.requires_grad  # the F pass records the graph the optimizer steps on


def written_out_f(net, x_t, t):
    """The consistency function f(x_t, t) = cos t x_t - sin t sigma_d F(x_t / sigma_d, t) at one time t (a float)."""
    ts = torch.full([x_t.shape[0]], t, dtype=x_t.dtype)
    F = consistency_model(net, LABELS)(x_t / SIGMA_DATA, ts)
    return math.cos(t) * x_t - math.sin(t) * SIGMA_DATA * F


def test_the_one_and_two_step_samplers_equal_their_formulas():
    net = network(torch.float64)
    generator = torch.Generator().manual_seed(3)
    z1, z2 = torch.randn([2, 2, 3, 8, 8], generator=generator, dtype=torch.float64)
    t_max = math.atan(80 / SIGMA_DATA)
    with torch.no_grad():
        one = consistency_sample(net, z1, LABELS, steps=1, dtype=torch.float64)
        two = consistency_sample(net, z1, LABELS, steps=2, randn_like=lambda x: z2, dtype=torch.float64)
        x0 = written_out_f(net, SIGMA_DATA * z1, t_max)
        x = math.cos(1.1) * x0 + math.sin(1.1) * SIGMA_DATA * z2
        # 1 / cos(t_max) = 160: the EDM input is 160 times x_t, its round-off 1e-14.
        torch.testing.assert_close(one, x0, rtol=0, atol=1e-12)
        torch.testing.assert_close(two, written_out_f(net, x, 1.1), rtol=0, atol=1e-12)
        # Any EDM denoiser D(x, sigma, labels) with its sigma_data samples alike.
        callable_one = consistency_sample(lambda x, s, c: net(x, s, c), z1, LABELS, steps=1, sigma_data=SIGMA_DATA,
                                          dtype=torch.float64)
        torch.testing.assert_close(callable_one, one, rtol=0, atol=0)


def test_the_n_step_times_are_the_edm_schedule_below_t_mid_mapped_by_arctan():
    t_max, t_mid = math.atan(80 / SIGMA_DATA), 1.1
    assert cm_times(1, t_max, t_mid, SIGMA_DATA) == [t_max]
    assert cm_times(2, t_max, t_mid, SIGMA_DATA) == pytest.approx([t_max, t_mid], abs=1e-15)
    top, bottom = (SIGMA_DATA * math.tan(t_mid)) ** (1 / RHO), SIGMA_MIN ** (1 / RHO)
    sigmas = [(top + i / 3 * (bottom - top)) ** RHO for i in range(3)]  # the first 3 of EDM Eq. 5's 4 levels
    expected = [t_max, *(math.atan(s / SIGMA_DATA) for s in sigmas)]
    assert cm_times(4, t_max, t_mid, SIGMA_DATA) == pytest.approx(expected, abs=1e-14)


@pytest.mark.parametrize("steps, t_mid, message", [
    (0, 1.1, "steps=0: a consistency model needs at least one step"),
    (2, 0.0, "t_mid=0: expected a time in (0, t_max)"),
    (2, 1.6, "t_mid=1.6: expected a time in (0, t_max)"),
    (2, float("nan"), "t_mid=nan: expected a time in (0, t_max)"),
    (2, "1.1", "t_mid='1.1': expected a time in (0, t_max)"),
])
def test_bad_sampler_settings_are_one_line(steps, t_mid, message):
    with pytest.raises(SamplerError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        check_cm_settings(steps, t_mid, math.atan(80 / SIGMA_DATA))
    assert "\n" not in str(e.value)


def test_consistency_models_are_told_apart_by_their_metadata():
    assert is_consistency_model({"consistency": {"method": "scd", "sigma_data": 0.5}})
    assert not is_consistency_model({"encoder": {}})
    assert not is_consistency_model({"consistency": "scd"})  # read from a file: only a record counts
    assert not is_consistency_model(None)

