"""EDM sampler against closed forms on Gaussian data, guidance (Eq. 152), and per-seed randomness."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.stats
import torch

from edm2 import sampler

S = 0.5  # sigma_data of the Gaussian test data
N_PIXELS = 1 << 18  # samples per distribution check: std of the sample std is S / sqrt(2 N) = 0.0007


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
    a = lambda t: t / (t * t + S * S)  # noqa: E731
    i = np.arange(num_steps)
    t = (sigma_max ** (1 / rho) + i / (num_steps - 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    t = np.append(t, 0.0)
    gamma = min(S_churn / num_steps, math.sqrt(2) - 1)
    var = sigma_max**2
    for k in range(num_steps):
        t_hat = t[k] * (1 + gamma) if S_min <= t[k] <= S_max else t[k]
        var += (t_hat**2 - t[k] ** 2) * S_noise**2
        h = t[k + 1] - t_hat
        last = k == num_steps - 1
        g = 1 + h * a(t_hat) if last else 1 + h / 2 * (a(t_hat) + a(t[k + 1]) + h * a(t_hat) * a(t[k + 1]))
        var *= g * g
    return math.sqrt(var)


def unit_noise(seed=0, num_pixels=N_PIXELS):
    return torch.randn([num_pixels // 4096, 1, 64, 64], generator=torch.Generator().manual_seed(seed))


def test_deterministic_sampler_matches_closed_form_on_gaussian():
    noise = unit_noise(0, N_PIXELS // 4)
    out = sampler.edm_sampler(exact_denoiser, noise)
    # The discretization error of 32 Heun steps (+ the sigma_max truncation), derived in closed form:
    std32 = predicted_std(32)
    error32 = abs(std32 - S)
    assert error32 < 0.02 * S
    # The sampler is linear here: each output is its input noise times exactly the predicted factor.
    torch.testing.assert_close(out, noise * std32, rtol=2e-5, atol=1e-6)
    # So the samples' std is S to within that error (plus the noise's own sampling error).
    assert abs(out.std().item() - S) <= error32 + 5 * S / math.sqrt(2 * noise.numel())
    # Heun is 2nd order: doubling the steps cuts the error about fourfold (Euler would only halve it).
    out64 = sampler.edm_sampler(exact_denoiser, noise, num_steps=64)
    error64 = abs((out64 / noise).median().item() - S)
    assert error64 == pytest.approx(abs(predicted_std(64) - S), rel=1e-2)
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


def test_guidance_is_the_lerp_of_the_two_denoisers():
    net, gnet = smooth_denoiser(0.7, 0.1), smooth_denoiser(0.4, 0.05)  # autoguidance: gnet sees labels too
    noise = torch.randn([2, 3, 4, 4], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    labels = torch.eye(3, dtype=torch.float64)[[0, 2]]
    for w in (0.5, 1.4, 2.5):

        def blended(x, sigma, labels, w=w):
            return w * net(x, sigma, labels) + (1 - w) * gnet(x, sigma, labels)  # paper Eq. 152

        guided = sampler.edm_sampler(net, noise, labels, gnet=gnet, guidance=w, num_steps=8, dtype=torch.float64)
        ref = sampler.edm_sampler(blended, noise, labels, num_steps=8, dtype=torch.float64)
        torch.testing.assert_close(guided, ref, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(guided, sampler.edm_sampler(net, noise, labels, num_steps=8, dtype=torch.float64))
    with pytest.raises(ValueError, match="gnet"):
        sampler.edm_sampler(net, noise, labels, guidance=1.4)


def test_seeded_inputs_depend_on_each_seed_alone():
    seeds = [5, 0, 123456789, 7]
    noise, labels, randn_like = sampler.seeded_inputs(seeds, 3, 4, 10)
    churn = [randn_like(noise), randn_like(noise)]
    for i, seed in enumerate(seeds):
        one_noise, one_labels, one_randn_like = sampler.seeded_inputs([seed], 3, 4, 10)
        assert torch.equal(noise[i : i + 1], one_noise)
        assert torch.equal(labels[i : i + 1], one_labels)
        for draw in churn:
            assert torch.equal(draw[i : i + 1], one_randn_like(one_noise))
    assert labels.sum(dim=1).eq(1).all() and len(set(labels.argmax(dim=1).tolist())) > 1
    fixed_noise, fixed_labels, _ = sampler.seeded_inputs(seeds, 3, 4, 10, class_idx=3)
    assert torch.equal(fixed_noise, noise) and fixed_labels.argmax(dim=1).eq(3).all()
    assert sampler.seeded_inputs(seeds, 3, 4, 0)[1] is None


def test_guidance_pair_must_match_in_shape_and_classes():
    def fake(resolution, channels, label_dim):
        return SimpleNamespace(img_resolution=resolution, img_channels=channels, label_dim=label_dim)

    sampler.check_guidance_pair(fake(8, 3, 10), fake(8, 3, 0))  # unconditional guide: fine
    sampler.check_guidance_pair(fake(8, 3, 10), fake(8, 3, 10))  # autoguidance: fine
    with pytest.raises(ValueError, match="resolution 16 with 3 channels"):
        sampler.check_guidance_pair(fake(8, 3, 10), fake(16, 3, 0))
    with pytest.raises(ValueError, match="resolution 8 with 4 channels"):
        sampler.check_guidance_pair(fake(8, 3, 10), fake(8, 4, 0))
    with pytest.raises(ValueError, match="5 classes"):
        sampler.check_guidance_pair(fake(8, 3, 10), fake(8, 3, 5))
