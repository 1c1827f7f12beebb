"""The sampler's solvers, one table: each a step rule of one signature, its evaluations per step, whether EDM's
churn (Algorithm 2) may raise the noise level before its steps, and whether it draws noise of its own. A new solver
is one function and one row.

A step rule step(denoise, x, t_cur, t_next, context) -> (x_next, denoised) takes x at noise level t_cur (after any
churn) to t_next, where denoise(x, t) is D(x; t) in the sampler's dtype (guided or not, as the step's level says):
along the probability-flow ODE dx/dsigma = (x - D(x; sigma)) / sigma (EDM Eq. 4 with sigma(t) = t; paper Eq. 153),
or, for a stochastic rule, along a reverse SDE whose fresh noise comes from context.randn_like. It returns x at
t_next and its first evaluation, D(x; t_cur) (what the sampler's callback reports). The last step ends at
t_next = 0, where a rule evaluates once. context (StepContext) holds the run's noise source, each image's draws from
its own generator (edm2.procedures.generation.SeededRandom), so an image depends on its seed and not on its batch; and
memory, a dict the rule may keep between the steps of one run (a multistep method's earlier evaluations), empty at
first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

Denoise = Callable[[torch.Tensor, float], torch.Tensor]


@dataclass
class StepContext:
    """What a step rule may use besides the denoiser: the run's per-image noise source (randn_like(x): unit normal
    noise of x's shape, each image's from its own generator) and the memory it keeps between the steps of one run."""

    randn_like: Callable[[torch.Tensor], torch.Tensor]
    memory: dict = field(default_factory=dict)


StepRule = Callable[[Denoise, torch.Tensor, float, float, StepContext], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Solver:
    """A solver's record: its step rule, its denoiser evaluations per step (the last step, to sigma = 0, evaluates
    once), whether churn applies, a few words for the command lines' help, and whether the rule draws noise (its
    samples then follow an SDE, not the ODE's solution)."""

    step: StepRule
    evaluations_per_step: int
    churn: bool
    about: str
    stochastic: bool = False


def euler_step(denoise: Denoise, x: torch.Tensor, t_cur: float, t_next: float, context: StepContext) -> tuple:
    """Euler's method: one step along the slope at t_cur (EDM Algorithm 2 without the correction)."""
    denoised = denoise(x, t_cur)
    return x + (t_next - t_cur) * ((x - denoised) / t_cur), denoised


def heun_step(denoise: Denoise, x: torch.Tensor, t_cur: float, t_next: float, context: StepContext) -> tuple:
    """Heun's 2nd-order method (EDM Algorithm 2, the release's): Euler's step corrected by the mean of the slopes at
    both ends, except on the step to sigma = 0."""
    denoised = denoise(x, t_cur)
    d_cur = (x - denoised) / t_cur
    x_next = x + (t_next - t_cur) * d_cur
    if t_next > 0:
        d_prime = (x_next - denoise(x_next, t_next)) / t_next
        x_next = x + (t_next - t_cur) * (0.5 * d_cur + 0.5 * d_prime)
    return x_next, denoised


def dpm2m_step(denoise: Denoise, x: torch.Tensor, t_cur: float, t_next: float, context: StepContext) -> tuple:
    """DPM-Solver++(2M) (Lu et al. 2022, Algorithm 2) with the data prediction x_theta = D (EDM's denoiser: alpha_t = 1,
    sigma_t = t, so lambda_t = -log t); context.memory holds the previous step's denoised image and h."""
    d_cur = denoise(x, t_cur)
    if t_next == 0:
        # The step to sigma = 0 (lambda = inf) has factors 0 and 1: the solution is the denoised image.
        return d_cur, d_cur
    h = math.log(t_cur / t_next)  # h_i = lambda_{t_i} - lambda_{t_{i-1}}
    memory = context.memory
    if "d_prev" not in memory:
        d = d_cur  # the first step is DPM-Solver++(1) (their Eq. 10 with one denoised image)
    else:
        # D_i = (1 + 1/(2 r_i)) x_theta(t_{i-1}) - 1/(2 r_i) x_theta(t_{i-2}), r_i = h_{i-1} / h_i
        half_over_r = 0.5 * h / memory["h_prev"]
        d = (1 + half_over_r) * d_cur - half_over_r * memory["d_prev"]
    memory.update(d_prev=d_cur, h_prev=h)
    # x_{t_i} = (sigma_{t_i} / sigma_{t_{i-1}}) x_{t_{i-1}} - alpha_{t_i} (e^{-h_i} - 1) D_i
    return (t_next / t_cur) * x - math.expm1(-h) * d, d_cur


def euler_ancestral_step(denoise: Denoise, x: torch.Tensor, t_cur: float, t_next: float,
                         context: StepContext) -> tuple:
    """Euler's step down to sigma_down, then fresh noise of std sigma_up back up to t_next (k-diffusion's
    sample_euler_ancestral with eta = 1 and s_noise = 1); no noise on the step to sigma = 0."""
    denoised = denoise(x, t_cur)
    # DDPM's ancestral step (Ho et al. 2020, their posterior's variance) in sigma: sigma_up^2 + sigma_down^2 =
    # t_next^2; the min guards the rounding of sigma_up <= t_next.
    sigma_up = min(t_next, math.sqrt(t_next**2 * (t_cur**2 - t_next**2) / t_cur**2))
    sigma_down = math.sqrt(t_next**2 - sigma_up**2)
    x_next = x + (sigma_down - t_cur) * ((x - denoised) / t_cur)
    if t_next > 0:
        x_next = x_next + context.randn_like(x) * sigma_up
    return x_next, denoised


# The solvers, on the noise levels of any schedule (edm2.schedules.SCHEDULES); heun is the release's.
# DPM-Solver++(2M) reuses the previous step's denoised image, which churn's fresh noise would make stale; the
# ancestral step adds fresh noise of its own (k-diffusion's has no churn).
SOLVERS: dict[str, Solver] = {
    "heun": Solver(heun_step, evaluations_per_step=2, churn=True, about="the release's"),
    "euler": Solver(euler_step, evaluations_per_step=1, churn=True, about="1st order"),
    "dpm2m": Solver(dpm2m_step, evaluations_per_step=1, churn=False, about="DPM-Solver++(2M), Lu et al. 2022"),
    "euler-ancestral": Solver(euler_ancestral_step, evaluations_per_step=1, churn=False, stochastic=True,
                              about="k-diffusion's sample_euler_ancestral; stochastic"),
}


def evaluations(solver: str, num_steps: int) -> int:
    """Denoiser evaluations (NFE) of num_steps steps of a solver: its evaluations per step, once on the last."""
    return SOLVERS[solver].evaluations_per_step * (num_steps - 1) + 1
