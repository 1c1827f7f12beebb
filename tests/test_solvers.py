"""The sampler's solvers (Heun, Euler, DPM-Solver++(2M), ancestral Euler): convergence order against exact solutions,
the release's Heun kept bitwise, evaluations counted, guidance per step."""

import importlib.util
import math
import sys

import numpy as np
import pytest
import torch

from edm2 import sampler
from edm2.procedures.generation import seeded_inputs
from tests.helpers import REPO, tiny_precond

SIGMA_MIN, SIGMA_MAX = 0.002, 80.0
STEPS = (8, 16, 32, 64)
ORDER = {"euler": 1, "heun": 2, "dpm2m": 2}
# The solvers of the probability-flow ODE; a stochastic one's samples follow an SDE instead (its own tests).
ODE_SOLVERS = [name for name, solver in sampler.SOLVERS.items() if not solver.stochastic]
# Noise values spread over the prior's bulk and tails, one per element (every solver acts elementwise here).
NOISE = torch.linspace(-2.5, 2.5, 41, dtype=torch.float64).reshape(-1, 1, 1, 1)
MU, S = 0.3, 0.5  # Gaussian data N(MU, S^2)
# A three-component 1-D Gaussian mixture: means, stds, weights.
MEANS = torch.tensor([-1.0, 0.5, 1.5], dtype=torch.float64)
STDS = torch.tensor([0.3, 0.4, 0.2], dtype=torch.float64)
WEIGHTS = torch.tensor([0.3, 0.5, 0.2], dtype=torch.float64)


def gaussian_denoiser(x, sigma, labels=None):
    """Optimal denoiser for N(MU, S^2): E[y | y + sigma n = x] = MU + (x - MU) S^2 / (S^2 + sigma^2)."""
    sigma = sigma.reshape(-1, 1, 1, 1)
    return MU + (x - MU) * S**2 / (S**2 + sigma**2)


def mixture_denoiser(x, sigma, labels=None):
    """Optimal denoiser for the mixture: each component's posterior mean, weighted by its posterior probability."""
    var = STDS**2 + sigma.reshape(-1, 1, 1, 1, 1) ** 2
    log_p = torch.log(WEIGHTS) - 0.5 * (x[..., None] - MEANS) ** 2 / var - 0.5 * torch.log(var)
    return (torch.softmax(log_p, -1) * (MEANS + STDS**2 / var * (x[..., None] - MEANS))).sum(-1)


def levels(x, sigma):
    return torch.full([x.shape[0]], sigma, dtype=torch.float64)


def exact_gaussian(x_max):
    """The PF-ODE's solution at SIGMA_MIN from x_max at SIGMA_MAX: x(sigma) = MU + (x_max - MU) sqrt(S^2 + sigma^2) /
    sqrt(S^2 + SIGMA_MAX^2) (dx/dsigma = (x - D) / sigma = sigma (x - MU) / (S^2 + sigma^2))."""
    return MU + (x_max - MU) * math.sqrt(S**2 + SIGMA_MIN**2) / math.sqrt(S**2 + SIGMA_MAX**2)


def exact_mixture(x_max, num=2000):
    """The mixture's PF-ODE solution at SIGMA_MIN by classical RK4 in u = log sigma (dx/du = x - D), num steps.

    RK4's error is O(h^4): halving num (2000 -> 1000) changes the result by 6e-10 at most, so at 2000 steps the
    reference is good to ~4e-11, five orders below the solvers' smallest error here (~4e-3 at 64 steps)."""
    u, h = math.log(SIGMA_MAX), (math.log(SIGMA_MIN) - math.log(SIGMA_MAX)) / num
    x = x_max

    def f(x, u):
        return x - mixture_denoiser(x, levels(x, math.exp(u)))

    for _ in range(num):
        k1 = f(x, u)
        k2 = f(x + h / 2 * k1, u + h / 2)
        k3 = f(x + h / 2 * k2, u + h / 2)
        k4 = f(x + h * k3, u + h)
        x, u = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4), u + h
    return x


@pytest.mark.parametrize("data", ["gaussian", "mixture"])
@pytest.mark.parametrize("solver", ODE_SOLVERS)
def test_each_solvers_error_against_the_exact_ode_solution_falls_at_its_order(solver, data):
    denoiser = gaussian_denoiser if data == "gaussian" else mixture_denoiser
    x_max = NOISE * SIGMA_MAX
    exact = exact_gaussian(x_max) if data == "gaussian" else exact_mixture(x_max)
    # Every solver ends with the same step from SIGMA_MIN to 0, the denoised image (its error does not shrink with
    # the steps: D(x; SIGMA_MIN) is not the ODE's x(0)); the reference takes that step from the exact solution, so
    # the error left is the solvers' own over SIGMA_MAX -> SIGMA_MIN.
    reference = denoiser(exact, levels(exact, SIGMA_MIN))
    errors = [(sampler.edm_sampler(denoiser, NOISE, num_steps=n, dtype=torch.float64, solver=solver) - reference)
              .abs().max().item() for n in STEPS]
    # A method of order p has error C N^-p + O(N^-(p+1)): the log-log slope tends to p. At 8 steps (h up to ~1.2 in
    # log sigma) the next term still shows, so the slope fitted over 8..64 may stray by ~0.2 from p (for second
    # order it tends to be steeper: the O(N^-3) term has the same sign); the last halving, 32 -> 64, is nearer the
    # limit: within 0.1 of 1 for Euler, [1.85, 2.3] for the second-order solvers. Euler's slope is also far from
    # 2 and the others' far from 1, so the bands tell the orders apart.
    slope = -np.polyfit(np.log(STEPS), np.log(errors), 1)[0]
    last = math.log2(errors[-2] / errors[-1])
    p = ORDER[solver]
    band, last_band = ((0.8, 1.2), (0.9, 1.1)) if p == 1 else ((1.7, 2.4), (1.85, 2.3))
    assert band[0] <= slope <= band[1], (errors, slope)
    assert last_band[0] <= last <= last_band[1], (errors, last)


def release_heun(net, noise, labels, gnet, num_steps, guidance, S_churn, S_min, S_max, S_noise, randn_like,
                 guidance_interval):
    """edm_sampler's loop as released before the solvers (commit f33d671), at the default levels in float32: the
    pinned reference that Heun must keep matching bit for bit."""

    def denoise(x, t, guided):
        sigma = torch.full([x.shape[0]], t, dtype=torch.float32)
        d = net(x, sigma, labels).to(torch.float32)
        if guidance == 1 or not guided:
            return d
        return torch.lerp(gnet(x, sigma, labels).to(torch.float32), d, guidance)

    t_steps = sampler.sigma_steps(num_steps, SIGMA_MIN, SIGMA_MAX, 7).tolist()
    gamma_max = min(S_churn / num_steps, math.sqrt(2) - 1)
    x_next = noise.to(torch.float32) * t_steps[0]
    for i, (t_cur, t_next) in enumerate(zip(t_steps[:-1], t_steps[1:])):
        x_cur = x_next
        gamma = gamma_max if S_min <= t_cur <= S_max else 0
        t_hat = t_cur + gamma * t_cur
        x_hat = x_cur
        guided = sampler.guided_step(t_cur, guidance_interval)
        if gamma > 0:
            x_hat = x_cur + math.sqrt(t_hat**2 - t_cur**2) * S_noise * randn_like(x_cur)
        d_cur = (x_hat - denoise(x_hat, t_hat, guided)) / t_hat
        x_next = x_hat + (t_next - t_hat) * d_cur
        if i < num_steps - 1:
            d_prime = (x_next - denoise(x_next, t_next, guided)) / t_next
            x_next = x_hat + (t_next - t_hat) * (0.5 * d_cur + 0.5 * d_prime)
    return x_next


def smooth_denoiser(scale, shift):
    """A nonlinear, label-dependent stand-in denoiser."""

    def denoise(x, sigma, labels=None):
        sigma = sigma.reshape(-1, 1, 1, 1)
        return torch.tanh(x * scale / (sigma**2 + scale**2) + shift * labels.argmax(dim=1).reshape(-1, 1, 1, 1))

    return denoise


@pytest.mark.parametrize("settings", [
    dict(num_steps=32, guidance=1, S_churn=0, guidance_interval=None),
    dict(num_steps=1, guidance=1, S_churn=0, guidance_interval=None),
    dict(num_steps=13, guidance=2.5, S_churn=30, guidance_interval=None),
    dict(num_steps=32, guidance=1.7, S_churn=0, guidance_interval=(0.28, 5.42)),
])
def test_heun_stays_bitwise_the_released_sampler(settings):
    net, gnet = smooth_denoiser(0.7, 0.1), smooth_denoiser(0.4, 0.05)
    noise = torch.randn([3, 2, 8, 8], generator=torch.Generator().manual_seed(5))
    labels = torch.eye(4)[[0, 3, 1]]
    churn = dict(S_min=0.05, S_max=10, S_noise=1.003)
    kwargs = dict(gnet=gnet, **settings, **churn)
    outputs = []
    for run in (release_heun, sampler.edm_sampler):
        generator = torch.Generator().manual_seed(9)  # the same churn noise for both
        randn_like = lambda x, generator=generator: torch.randn(x.shape, generator=generator)  # noqa: E731
        outputs.append(run(net, noise, labels, randn_like=randn_like, **kwargs))
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(sampler.edm_sampler(net, noise, labels, **{**kwargs, "S_churn": 0}, solver="heun"),
                       release_heun(net, noise, labels, randn_like=None, **{**kwargs, "S_churn": 0}))


@pytest.mark.parametrize("solver", sampler.SOLVERS)
def test_evaluations_counts_the_denoiser_calls(solver):
    noise = torch.zeros([1, 1, 2, 2])
    for num_steps in (1, 2, 8, 32):
        calls = []

        def net(x, sigma, labels=None):
            calls.append(sigma[0].item())
            return torch.zeros_like(x)

        sampler.edm_sampler(net, noise, num_steps=num_steps, solver=solver)
        assert len(calls) == sampler.evaluations(solver, num_steps)
    assert sampler.evaluations("heun", 32) == 63 and sampler.evaluations("euler", 32) == 32


@pytest.mark.parametrize("solver", ["euler", "dpm2m"])
def test_one_evaluation_solvers_guide_exactly_the_steps_whose_level_lies_in_the_interval(solver):
    t = sampler.sigma_steps(8, SIGMA_MIN, SIGMA_MAX, 7).tolist()
    net_calls, gnet_calls = [], []

    def recording(denoiser, calls):
        def denoise(x, sigma, labels):
            calls.append(sigma[0].item())
            return denoiser(x, sigma, labels)

        return denoise

    noise = torch.randn([2, 3, 4, 4], generator=torch.Generator().manual_seed(0))
    sampler.edm_sampler(recording(smooth_denoiser(0.7, 0.1), net_calls), noise, torch.eye(3)[[0, 2]],
                        gnet=recording(smooth_denoiser(0.4, 0.05), gnet_calls), guidance=2.5, num_steps=8,
                        guidance_interval=(t[5], t[2]), solver=solver)
    # One evaluation per step, at the step's own level: steps 2, 3 and 4 lie in (t[5], t[2]].
    np.testing.assert_allclose(net_calls, t[:-1], rtol=1e-6)  # float32 sigmas of float64 levels
    assert gnet_calls == net_calls[2:5]


# ---------------------------------------------------------------------------------------------------
# The ancestral Euler step (euler-ancestral): k-diffusion's sample_euler_ancestral, on each image's own noise.

def k_diffusion_sigmas_exponential(n, sigma_min, sigma_max):
    """k-diffusion's get_sigmas_exponential by its formula: n levels evenly spaced in log sigma, then 0."""
    return [*torch.linspace(math.log(sigma_max), math.log(sigma_min), n, dtype=torch.float64).exp().tolist(), 0.0]


def k_diffusion_euler_ancestral(denoiser, x, sigmas, draws):
    """k-diffusion's sample_euler_ancestral (eta = 1, s_noise = 1) written out in float64 from its formula, with
    sigma_up and sigma_down in closed form: sigma_up^2 = s'^2 (s^2 - s'^2) / s^2 and sigma_down = sqrt(s'^2 -
    sigma_up^2) = s'^2 / s. draws[i] is the unit noise the step from sigmas[i] adds (none on the step to 0)."""
    x = x.double()
    for i, (s, s_next) in enumerate(zip(sigmas[:-1], sigmas[1:])):
        denoised = denoiser(x, levels(x, s))
        d = (x - denoised) / s
        x = x + d * (s_next**2 / s - s)
        if s_next > 0:
            x = x + draws[i] * (s_next * math.sqrt(1 - (s_next / s) ** 2))
    return x


def recorded_noise(seed=1):
    """A noise source of its own generator that keeps every draw (for the reference to add the same noise)."""
    generator, draws = torch.Generator().manual_seed(seed), []

    def randn_like(x):
        draws.append(torch.randn(x.shape, generator=generator, dtype=x.dtype))
        return draws[-1]

    return randn_like, draws


@pytest.mark.parametrize("num_steps", [1, 2, 16])
def test_euler_ancestral_is_k_diffusions_sample_euler_ancestral_given_the_same_noise(num_steps):
    x_max = NOISE * SIGMA_MAX
    randn_like, draws = recorded_noise()
    out = sampler.edm_sampler(gaussian_denoiser, NOISE, num_steps=num_steps, dtype=torch.float64,
                              solver="euler-ancestral", schedule="exponential", randn_like=randn_like)
    # One draw of x's shape per step but the last (to sigma = 0), each from the noise source.
    assert len(draws) == num_steps - 1 and all(draw.shape == NOISE.shape for draw in draws)
    reference = k_diffusion_euler_ancestral(gaussian_denoiser, x_max,
                                            k_diffusion_sigmas_exponential(num_steps, SIGMA_MIN, SIGMA_MAX), draws)
    # Both in float64: each step rounds ~12 operations (the levels too: linspace and a power differ by a few eps)
    # at 2.2e-16 relative of |x| <= 2.5 SIGMA_MAX = 200, ~5e-13 a step; a later step passes an earlier error on
    # times sigma_down / sigma + (1 - sigma_down / sigma) S^2 / (S^2 + sigma^2) <= 1 (Gaussian data), so 16 steps
    # stay within 1e-11. Noise left out (Euler's step) moves x by 1e-3 or more, eight orders above.
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-11)
    if num_steps > 1:
        deterministic = sampler.edm_sampler(gaussian_denoiser, NOISE, num_steps=num_steps, dtype=torch.float64,
                                            solver="euler", schedule="exponential")
        assert (out - deterministic).abs().max() > 1e-3


# A batch changes only how batched kernels may order an image's float32 sums: a few eps (1.2e-7) relative each,
# ~1e-6 at most after 8 evaluations of the tiny network on values of order 1; 1e-5 leaves room, five orders below
# the O(1) change that noise from a generator shared by the batch makes (asserted below).
BATCH_ROUNDING = 1e-5


def latents_in_batches(net, batches, randn_like=None, **kwargs):
    """The sampled latents of seeds given in batches, each batch's noise per seed (seeded_inputs, as generate.py
    samples); randn_like replaces that noise source for the ancestral steps, from a generator seeded once a batch."""
    out = []
    for seeds in batches:
        noise, labels, per_seed = seeded_inputs(seeds, net.img_channels, net.img_resolution, net.label_dim)
        if randn_like is not None:
            torch.manual_seed(0)
        out.append(sampler.edm_sampler(net, noise, labels, randn_like=randn_like or per_seed, num_steps=8,
                                       solver="euler-ancestral", **kwargs))
    return torch.cat(out)


@pytest.mark.parametrize("schedule", ["edm", "exponential"])
def test_euler_ancestral_images_depend_on_their_seed_and_not_their_batch(schedule):
    torch.manual_seed(0)
    net = tiny_precond(8, 3, label_dim=5).eval().requires_grad_(False)
    together = latents_in_batches(net, [range(8)], schedule=schedule)
    for batches in ([range(3), range(3, 8)], [range(i, i + 1) for i in range(8)]):
        torch.testing.assert_close(latents_in_batches(net, batches, schedule=schedule), together, rtol=0,
                                   atol=BATCH_ROUNDING)
    # The check can fail: an ancestral step drawing from one generator for the batch (torch.randn_like) gives a
    # seed's image that changes with its batch.
    shared = [latents_in_batches(net, batches, torch.randn_like, schedule=schedule)
              for batches in ([range(8)], [range(3), range(3, 8)])]
    assert (shared[0] - shared[1]).abs().max() > 1e4 * BATCH_ROUNDING


def test_euler_ancestral_takes_no_churn():
    with pytest.raises(sampler.SamplerError, match="S_churn=1: solver euler-ancestral takes no churn; churn needs heun"):
        sampler.edm_sampler(gaussian_denoiser, NOISE, num_steps=4, solver="euler-ancestral", S_churn=1.0)


def test_the_nfe_benchmark_measures_the_ode_solvers_and_leaves_out_a_stochastic_one(capsys, monkeypatch):
    # scripts/bench_solvers.py measures the distance to the ODE's solution, which an SDE's samples do not approach:
    # doubling the steps of euler-ancestral would run to --max-steps for nothing.
    spec = importlib.util.spec_from_file_location("bench_solvers_script", REPO / "scripts" / "bench_solvers.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    result = bench.nfe_to_heun_63(lambda solver, steps: sampler.edm_sampler(
        gaussian_denoiser, NOISE, num_steps=steps, dtype=torch.float64, solver=solver), ref_steps=64, max_steps=64)
    assert list(result["solvers"]) == ODE_SOLVERS
    assert "euler-ancestral: stochastic" in capsys.readouterr().out
