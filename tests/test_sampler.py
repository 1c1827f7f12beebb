"""EDM sampler against closed forms on Gaussian data, guidance (Eq. 152), and the settings it refuses."""

import math
import re

import numpy as np
import pytest
import scipy.stats
import torch

from edm2 import sampler
from tests.helpers import randomized, tiny_precond

S = 0.5  # sigma_data of the Gaussian test data
N_PIXELS = 1 << 18  # samples per distribution check: std of the sample std is S / sqrt(2 N) = 0.0007
# Rounding bound of one sampler step with exact_denoiser, in units of the precision's rounding error u
# (2**-24 in float32). Every operation is elementwise and each element is its noise times a factor, so
# each rounding adds at most u of that element: each of the two denoiser calls rounds sigma, sigma**2,
# + S**2 and the division (4, x * S**2 is exact); then x - D, the float32 step size t and the division
# by it (3), the step size h and h * d (2), and the sum (1) for Euler (2 x 4 + 2 x 3 + 2 + 1), and
# 0.5 * d_cur + 0.5 * d_prime (1), h * (...) (2) and the sum (1) for Heun's correction: 21, rounded up
# to 24. Each step's terms are at most |x| (|h| <= t_hat), and later steps scale an error as they scale
# x, so the relative error after N steps is at most (2 + 24 N) u (2 for noise * sigma_max).
ROUNDINGS_PER_STEP = 24


def exact_denoiser(x, sigma, labels=None):
    """Optimal denoiser for data ~ N(0, S^2): D(x; sigma) = x S^2 / (sigma^2 + S^2)."""
    sigma = sigma.reshape(-1, 1, 1, 1)
    return x * S**2 / (sigma**2 + S**2)


def predicted_std(num_steps, S_churn=0.0, S_min=0.0, S_max=math.inf, S_noise=1.0, sigma_min=0.002, sigma_max=80.0, rho=7.0):
    """Std of the sampler's output for unit noise, propagated in closed form in float64.

    With the exact denoiser the ODE is dx/dsigma = a(sigma) x, a = sigma / (sigma^2 + S^2), so every step
    multiplies x by a constant: Euler 1 + h a(t_hat), Heun 1 + h/2 (a(t_hat) + a(t_next) + h a(t_hat) a(t_next)).
    Churn adds independent noise of variance (t_hat^2 - t^2) S_noise^2 before the step.
    """
    i = np.arange(num_steps)
    t = (sigma_max ** (1 / rho) + i / (num_steps - 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    t = np.append(t, 0.0)
    gamma = min(S_churn / num_steps, math.sqrt(2) - 1)
    var = sigma_max**2
    for k in range(num_steps):
        t_hat = t[k] * (1 + gamma) if S_min <= t[k] <= S_max else t[k]
        var += (t_hat**2 - t[k] ** 2) * S_noise**2
        g = step_factor(t_hat, t[k + 1], last=k == num_steps - 1)
        var *= g * g
    return math.sqrt(var)


def step_factor(t_hat, t_next, last):
    """The factor one step from t_hat to t_next multiplies x by with exact_denoiser (see predicted_std), in float64."""
    a = lambda t: t / (t * t + S * S)  # noqa: E731
    h = t_next - t_hat
    return 1 + h * a(t_hat) if last else 1 + h / 2 * (a(t_hat) + a(t_next) + h * a(t_hat) * a(t_next))


def unit_noise(seed=0, num_pixels=N_PIXELS):
    return torch.randn([num_pixels // 4096, 1, 64, 64], generator=torch.Generator().manual_seed(seed))


def seeded_randn_like(seed=1):
    """A noise source of its own generator: two runs given sources of one seed draw the same churn and ancestral
    noise, so a stochastic solver's runs compare as the deterministic ones'."""
    generator = torch.Generator().manual_seed(seed)
    return lambda x: torch.randn(x.shape, generator=generator, dtype=x.dtype)


def rounding_bound(num_steps, dtype):
    """Relative error bound of the sampler's output with exact_denoiser (see ROUNDINGS_PER_STEP)."""
    return (2 + ROUNDINGS_PER_STEP * num_steps) * torch.finfo(dtype).eps / 2


def test_deterministic_sampler_matches_closed_form_on_gaussian():
    noise = unit_noise(0, N_PIXELS // 4)
    out = sampler.edm_sampler(exact_denoiser, noise)
    # The discretization error of 32 Heun steps (+ the sigma_max truncation), derived in closed form:
    std32 = predicted_std(32)
    error32 = abs(std32 - S)
    assert error32 < 0.02 * S
    # The sampler is linear here: each output is its input noise times the predicted factor, up to float32
    # rounding (bound: 770 u = 4.6e-5; elementwise, so no absolute term).
    torch.testing.assert_close(out.double(), noise.double() * std32, rtol=rounding_bound(32, torch.float32), atol=0)
    # So the samples' std is S to within that error (plus the noise's own sampling error).
    assert abs(out.std().item() - S) <= error32 + 5 * S / math.sqrt(2 * noise.numel())
    # Heun is 2nd order: doubling the steps cuts the error about fourfold (Euler would only halve it).
    # In float64 the factor is exact to rounding_bound(64) = 2.7e-13 relative, 1.4e-13 of the 1.8e-3 error.
    out64 = sampler.edm_sampler(exact_denoiser, noise.double(), num_steps=64, dtype=torch.float64)
    factor64 = out64 / noise.double()
    predicted64 = predicted_std(64)
    assert (factor64 - predicted64).abs().max().item() <= rounding_bound(64, torch.float64) * predicted64
    error64 = abs(factor64.median().item() - S)
    assert error64 == pytest.approx(abs(predicted64 - S), rel=1e-9)
    assert 3.5 < error32 / error64 < 5


def test_churn_lands_on_the_data_distribution():
    churn = dict(S_churn=40, S_min=0.05, S_max=50, S_noise=1.003)
    torch.manual_seed(1)
    noise = unit_noise(1)
    out = sampler.edm_sampler(exact_denoiser, noise, **churn)
    std_pred = predicted_std(32, **churn)
    tolerance = 5 * std_pred / math.sqrt(2 * N_PIXELS)  # 5 standard errors of a sample std
    # The added noise is really there: the deterministic sampler's std differs by far more than the tolerance.
    assert abs(std_pred - predicted_std(32)) > 5 * tolerance
    assert abs(out.std().item() - std_pred) < tolerance
    # The output is Gaussian with the predicted std, and that std approaches S as steps are added.
    sub = (out.flatten()[::16] / std_pred).double().numpy()
    assert scipy.stats.kstest(sub, "norm").pvalue > 1e-3
    assert abs(std_pred - S) < 0.06 * S
    out128 = sampler.edm_sampler(exact_denoiser, noise, num_steps=128, **churn)
    std128 = predicted_std(128, **churn)
    assert abs(std128 - S) < abs(std_pred - S) / 3
    assert abs(out128.std().item() - std128) < tolerance


@pytest.mark.parametrize("solver", sampler.SOLVERS)
def test_the_callback_sees_each_step_in_k_diffusion_keys_and_changes_nothing(solver):
    noise, num_steps = unit_noise(2, 4096), 8
    seen = []
    out = sampler.edm_sampler(exact_denoiser, noise, num_steps=num_steps, solver=solver, callback=seen.append,
                              randn_like=seeded_randn_like())
    assert torch.equal(out, sampler.edm_sampler(exact_denoiser, noise, num_steps=num_steps, solver=solver,
                                                randn_like=seeded_randn_like()))
    levels = sampler.sigma_steps(num_steps, 0.002, 80, 7).tolist()
    assert [step["i"] for step in seen] == list(range(num_steps))
    assert [step["sigma"] for step in seen] == [step["sigma_hat"] for step in seen] == levels[:-1]
    assert torch.equal(seen[0]["x"], noise * levels[0])
    for step in seen:
        assert torch.equal(step["denoised"], exact_denoiser(step["x"], torch.full([1], step["sigma"])))
    if solver == "euler":  # each point is the previous one's Euler step, and the sample the last one's
        for step, x_next in zip(seen, [*(s["x"] for s in seen[1:]), out]):
            h = levels[step["i"] + 1] - step["sigma"]
            assert torch.equal(x_next, step["x"] + h * ((step["x"] - step["denoised"]) / step["sigma"]))
    if solver == "dpm2m":  # the last step ends at sigma = 0, where the sample is the denoised image
        assert torch.equal(out, seen[-1]["denoised"])


def test_heuns_trajectory_is_the_noise_times_the_closed_form_factor_of_each_step():
    # With the exact denoiser every Heun step multiplies x by step_factor, so the k-th point the callback sees is
    # the noise times sigma_max times the product of the first k factors, up to k steps' rounding.
    noise, num_steps = unit_noise(3, 4096), 8
    seen = []
    sampler.edm_sampler(exact_denoiser, noise, num_steps=num_steps, callback=seen.append)
    levels = sampler.sigma_steps(num_steps, 0.002, 80, 7).tolist()
    factor = levels[0]
    for k, step in enumerate(seen):
        torch.testing.assert_close(step["x"].double(), noise.double() * factor, atol=0,
                                   rtol=rounding_bound(k, torch.float32))
        factor *= step_factor(levels[k], levels[k + 1], last=k == num_steps - 1)


def smooth_denoiser(scale, shift):
    """A nonlinear, label-dependent stand-in denoiser."""

    def denoise(x, sigma, labels=None):
        sigma = sigma.reshape(-1, 1, 1, 1)
        bias = 0 if labels is None else shift * labels.argmax(dim=1).reshape(-1, 1, 1, 1)
        return torch.tanh(x * scale / (sigma**2 + scale**2) + bias)

    return denoise


def test_guidance_one_never_calls_the_guiding_net():
    def gnet(*args):
        raise AssertionError("the guiding net must not run at guidance 1")

    net = smooth_denoiser(0.7, 0.1)
    noise = torch.randn([2, 3, 4, 4], generator=torch.Generator().manual_seed(0))
    labels = torch.eye(3)[[0, 2]]
    ref = sampler.edm_sampler(net, noise, labels, num_steps=8)
    assert torch.equal(sampler.edm_sampler(net, noise, labels, gnet=gnet, guidance=1, num_steps=8), ref)


@pytest.mark.parametrize("solver", sampler.SOLVERS)
def test_guidance_is_the_lerp_of_the_two_denoisers(solver):
    net, gnet = smooth_denoiser(0.7, 0.1), smooth_denoiser(0.4, 0.05)  # autoguidance: gnet sees labels too
    noise = torch.randn([2, 3, 4, 4], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    labels = torch.eye(3, dtype=torch.float64)[[0, 2]]
    for w in (0.5, 1.4, 2.5):

        def blended(x, sigma, labels, w=w):
            return w * net(x, sigma, labels) + (1 - w) * gnet(x, sigma, labels)  # paper Eq. 152

        guided = sampler.edm_sampler(net, noise, labels, gnet=gnet, guidance=w, num_steps=8, dtype=torch.float64,
                                     solver=solver, randn_like=seeded_randn_like())
        ref = sampler.edm_sampler(blended, noise, labels, num_steps=8, dtype=torch.float64, solver=solver,
                                  randn_like=seeded_randn_like())
        # lerp and the written-out blend round differently: a few float64 eps (2.2e-16) of values up to
        # |w| + |1 - w| <= 4 in each of at most 15 denoiser calls, 1.3e-14 in all; each later step scales such a
        # difference by t_next / t_hat <= 1 (tanh's slope is small; dpm2m's extrapolation weights 1 + h / (2 h_prev)
        # and h / (2 h_prev) stay below 2 on these levels; the ancestral step's sigma_down / t_cur < 1, and its
        # noise is the same draws in both), so 1e-12 bounds it with room.
        torch.testing.assert_close(guided, ref, rtol=1e-12, atol=1e-12)
        unguided = sampler.edm_sampler(net, noise, labels, num_steps=8, dtype=torch.float64, solver=solver,
                                       randn_like=seeded_randn_like())
        assert not torch.allclose(guided, unguided)
    with pytest.raises(sampler.SamplerError, match="gnet"):
        sampler.edm_sampler(net, noise, labels, guidance=1.4)


# The sampler's defaults: paper Appendix D.1 (EDM's deterministic sampler, 32 steps, no guidance).
DEFAULTS = dict(num_steps=32, sigma_min=0.002, sigma_max=80.0, rho=7.0, guidance=1.0, S_churn=0.0, S_min=0.0,
                S_max=math.inf, S_noise=1.0)


def test_default_settings_pass_the_check():
    sampler.check_settings(**DEFAULTS)
    sampler.check_settings(**{**DEFAULTS, **dict(num_steps=1, sigma_min=1e-3, sigma_max=1e3, rho=1.0, guidance=-2.0,
                                                 S_churn=80.0, S_noise=0.0)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_guidance_is_bounded_where_the_blend_still_holds_the_guides_share(dtype):
    bound = 1 / torch.finfo(dtype).eps  # 2**23 in float32, 2**10 in float16
    sampler.check_settings(**{**DEFAULTS, "guidance": -(bound - 1), "dtype": dtype})
    for guidance in (bound, -bound, 1e308):
        with pytest.raises(sampler.SamplerError, match=re.escape(f"guidance={guidance:g}: must lie within")):
            sampler.check_settings(**{**DEFAULTS, "guidance": guidance, "dtype": dtype})
    # The bound's reason: at w = 1 / eps, Eq. 152's D_gnet share (here 0.25, D_net - D_gnet = 1) rounds away.
    d_guide, d = torch.tensor(0.25, dtype=dtype), torch.tensor(1.25, dtype=dtype)
    assert torch.lerp(d_guide, d, bound) == bound
    assert torch.lerp(d_guide, d, bound / 2) == bound / 2 + 0.25


@pytest.mark.parametrize("settings, message", [
    (dict(num_steps=0), "at least one step"),
    (dict(sigma_max=math.inf), "sigma_max=inf: not a finite number"),
    (dict(sigma_min=math.nan), "sigma_min=nan: not a finite number"),
    (dict(rho=math.inf), "rho=inf"),
    (dict(guidance=math.nan), "guidance=nan"),
    (dict(S_churn=math.nan), "S_churn=nan"),
    (dict(S_min=math.inf), "S_min=inf"),
    (dict(S_max=math.nan), "S_max=nan"),
    (dict(S_noise=-math.inf), "S_noise=-inf"),
    (dict(sigma_min=0.0), "sigma_min=0: must be positive"),
    (dict(rho=-7.0), "rho=-7: must be positive"),
    (dict(sigma_min=80.0), "must be below sigma_max=80"),
    (dict(S_churn=-1.0), "cannot be negative"),
    # float32 squares overflow above 1.8e19 and vanish below 3.7e-23 (the smallest subnormal is 1.4e-45) ...
    (dict(sigma_max=1e20), "squares are finite and above 0 in torch.float32"),
    (dict(sigma_min=1e-30), "squares are finite and above 0 in torch.float32"),
    # ... and sigma_max ** (1 / rho) overflows float64 for a tiny rho.
    (dict(rho=1e-3), "not decreasing levels"),
    (dict(solver="rk4"), "solver='rk4': expected one of heun, euler, dpm2m"),
    (dict(solver="dpm2m", S_churn=1.0), "churn needs heun or euler"),
])
def test_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(sampler.SamplerError, match=re.escape(message)):
        sampler.check_settings(**{**DEFAULTS, **settings})
    with pytest.raises(sampler.SamplerError, match=re.escape(message)):
        sampler.edm_sampler(exact_denoiser, torch.zeros([1, 1, 2, 2]), **settings)


def test_float64_sampling_accepts_levels_float32_cannot_hold():
    sampler.check_settings(**{**DEFAULTS, "sigma_max": 1e20}, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------
# The guidance interval (Kynkaanniemi et al., NeurIPS 2024): guidance only for steps with sigma in (lo, hi].

def recording(denoiser, calls):
    """denoiser, appending the noise level of every call to calls."""

    def denoise(x, sigma, labels=None):
        calls.append(sigma[0].item())
        return denoiser(x, sigma, labels)

    return denoise


def interval_inputs():
    noise = torch.randn([2, 3, 4, 4], generator=torch.Generator().manual_seed(0))
    return smooth_denoiser(0.7, 0.1), smooth_denoiser(0.4, 0.05), noise, torch.eye(3)[[0, 2]]


@pytest.mark.parametrize("solver", sampler.SOLVERS)
def test_an_interval_holding_no_step_is_unguided_sampling_bitwise(solver):
    net, _, noise, labels = interval_inputs()

    def gnet(*args):
        raise AssertionError("the guiding net must not run outside the interval")

    unguided = sampler.edm_sampler(net, noise, labels, num_steps=8, solver=solver, randn_like=seeded_randn_like())
    # Above sigma_max = 80, and between two levels: no step's level lies in either interval.
    t = sampler.sigma_steps(8, 0.002, 80, 7).tolist()
    for interval in [(80, 1e6), (t[4], (t[4] + t[3]) / 2)]:
        out = sampler.edm_sampler(net, noise, labels, gnet=gnet, guidance=2.5, num_steps=8, guidance_interval=interval,
                                  solver=solver, randn_like=seeded_randn_like())
        assert torch.equal(out, unguided)


@pytest.mark.parametrize("solver", sampler.SOLVERS)
def test_the_interval_from_zero_to_infinity_is_plain_guidance_bitwise(solver):
    net, gnet, noise, labels = interval_inputs()
    for churn in ({}, dict(S_churn=10, S_min=0.01, S_max=1))[: 2 if sampler.SOLVERS[solver].churn else 1]:
        plain = sampler.edm_sampler(net, noise, labels, gnet=gnet, guidance=2.5, num_steps=8, **churn,
                                    randn_like=lambda x: torch.ones_like(x), solver=solver)
        out = sampler.edm_sampler(net, noise, labels, gnet=gnet, guidance=2.5, num_steps=8, **churn,
                                  randn_like=lambda x: torch.ones_like(x), guidance_interval=(0, math.inf),
                                  solver=solver)
        assert torch.equal(out, plain)


def test_guidance_covers_both_evaluations_of_the_steps_whose_level_lies_in_the_interval():
    net, gnet, noise, labels = interval_inputs()
    t = sampler.sigma_steps(8, 0.002, 80, 7).tolist()
    # (t[5], t[2]]: steps 2, 3 and 4 (t[5] itself is left out, t[2] is in); with churn up to sigma 20, the
    # steps from t[2] ~ 15.6 and t[3] ~ 5.4 evaluate at t_hat = 1.41 t above t[2]: their level t decides.
    assert t[2] < 20 < t[1]
    for churn in ({}, dict(S_churn=100, S_max=20)):
        gnet_calls, net_calls = [], []
        sampler.edm_sampler(recording(net, net_calls), noise, labels, gnet=recording(gnet, gnet_calls), guidance=2.5,
                            num_steps=8, guidance_interval=(t[5], t[2]), randn_like=torch.zeros_like, **churn)
        # net runs twice per step (Euler at t_hat, Heun at t_next) but once in the last; gnet alongside it
        # in steps 2, 3 and 4 only.
        assert len(net_calls) == 15 and gnet_calls == net_calls[4:10]
        t_hat = [level * (1 + min(churn.get("S_churn", 0) / 8, math.sqrt(2) - 1) * (level <= 20)) for level in t]
        expected = [t_hat[2], t[3], t_hat[3], t[4], t_hat[4], t[5]]
        np.testing.assert_allclose(gnet_calls, expected, rtol=1e-6)  # float32 sigmas of float64 levels


def test_the_papers_edm2_xxl_interval_guides_steps_13_to_22_of_32():
    # (0.28, 5.42] at the default 32 steps; the paper's code picks steps by index, 13..22 for these levels.
    net, gnet, noise, labels = interval_inputs()
    gnet_calls, net_calls = [], []
    sampler.edm_sampler(recording(net, net_calls), noise[:1], labels[:1], gnet=recording(gnet, gnet_calls),
                        guidance=2.0, guidance_interval=(0.28, 5.42))
    t = sampler.sigma_steps(32, 0.002, 80, 7).tolist()
    assert t[12] > 5.42 >= t[13] and t[22] > 0.28 >= t[23]
    assert gnet_calls == net_calls[2 * 13 : 2 * 23]


@pytest.mark.parametrize("interval", [(1.0, 1.0), (2.0, 1.0), (-0.1, 1.0), (math.nan, 1.0), (0.0, math.nan),
                                      (math.inf, math.inf)])
def test_an_interval_that_holds_no_levels_by_construction_is_refused(interval):
    net, gnet, noise, labels = interval_inputs()
    with pytest.raises(sampler.SamplerError, match="guidance interval"):
        sampler.edm_sampler(net, noise, labels, gnet=gnet, guidance=2, num_steps=2, guidance_interval=interval)


# ---------------------------------------------------------------------------------------------------
# Classifier-free guidance from one network (gnet=SELF): its own prediction for the all-zero label guides it.

def self_guidance_inputs():
    net = randomized(tiny_precond(label_dim=3, use_fp16=False)).eval().requires_grad_(False)
    noise = torch.randn([2, 3, 8, 8], generator=torch.Generator().manual_seed(1))
    return net, noise, torch.eye(3)[[0, 2]]


# Float32 round-off of one tiny-U-Net evaluation whose kernels see a batch of 2N instead of N images: the same
# products summed in another order. A sum of n float32 terms reassociated differs by at most n eps sum|terms|
# (eps = 2**-24 in float32, relative to the terms), the widest sum here being a 3x3 convolution over 2 x 16
# channels (n = 288); the layers' normalizations keep values near 1, so 288 eps ~ 2e-5 per layer, and the tiny
# U-Net has about a dozen layers in sequence: 5e-4 bounds an evaluation with room.
BATCH_REASSOCIATION = 5e-4


def batch_sizes(net, calls):
    """net, appending the batch size of every call to calls."""

    def counted(x, sigma, labels):
        calls.append(x.shape[0])
        return net(x, sigma, labels)

    return counted


def test_the_doubled_batch_is_one_call_equal_to_two_calls():
    net, noise, labels = self_guidance_inputs()
    calls = []
    counted = batch_sizes(net, calls)
    x, sigma = noise * 2.0, torch.full([2], 2.0)
    cond, uncond = sampler.conditional_and_unconditional(counted, x, sigma, labels)
    assert calls == [4]
    torch.testing.assert_close(cond, net(x, sigma, labels), rtol=BATCH_REASSOCIATION, atol=BATCH_REASSOCIATION)
    torch.testing.assert_close(uncond, net(x, sigma, torch.zeros_like(labels)), rtol=BATCH_REASSOCIATION,
                               atol=BATCH_REASSOCIATION)
    assert not torch.allclose(cond, uncond)  # the label matters, so the halves are not swapped unnoticed


def test_self_guidance_at_one_is_unguided_sampling_bitwise_with_no_doubled_batch():
    net, noise, labels = self_guidance_inputs()
    calls = []
    counted = batch_sizes(net, calls)
    unguided = sampler.edm_sampler(net, noise, labels, num_steps=4)
    out = sampler.edm_sampler(counted, noise, labels, gnet=sampler.SELF, guidance=1, num_steps=4)
    assert torch.equal(out, unguided) and calls == [2] * 7


def test_self_guidance_equals_a_separate_copy_given_the_all_zero_label():
    net, noise, labels = self_guidance_inputs()
    copy = tiny_precond(label_dim=3, use_fp16=False).eval().requires_grad_(False)
    copy.load_state_dict(net.state_dict())
    calls = []
    counted = batch_sizes(net, calls)
    def unconditional_copy(x, sigma, labels):
        return copy(x, sigma, torch.zeros_like(labels))

    interval = (0.5, 10.0)
    guided = sampler.edm_sampler(counted, noise, labels, gnet=sampler.SELF, guidance=2.0, num_steps=4,
                                 guidance_interval=interval)
    ref = sampler.edm_sampler(net, noise, labels, gnet=unconditional_copy, guidance=2.0, num_steps=4,
                              guidance_interval=interval)
    # Each of the 7 evaluations carries at most BATCH_REASSOCIATION of relative round-off, blended with weights
    # |w| + |1 - w| = 3, and a later step passes an earlier error on scaled by at most 1: 7 x 3 x 5e-4 ~ 1e-2.
    tolerance = 7 * 3 * BATCH_REASSOCIATION
    torch.testing.assert_close(guided, ref, rtol=tolerance, atol=tolerance)
    # Guided steps (t_cur in (0.5, 10]) evaluate the doubled batch once; the others the plain batch.
    t = sampler.sigma_steps(4, 0.002, 80, 7).tolist()
    evaluations = [1 if i == 3 else 2 for i in range(4)]
    assert calls == [n for i in range(4) for n in [4 if interval[0] < t[i] <= interval[1] else 2] * evaluations[i]]
    assert 4 in calls and 2 in calls
    assert not torch.allclose(guided, sampler.edm_sampler(net, noise, labels, num_steps=4))


def test_self_guidance_without_labels_is_refused():
    net, noise, _ = self_guidance_inputs()
    with pytest.raises(sampler.SamplerError, match="needs class labels"):
        sampler.edm_sampler(net, noise, None, gnet=sampler.SELF, guidance=2.0, num_steps=4)
