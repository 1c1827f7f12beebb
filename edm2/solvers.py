"""The sampler's ODE solvers, one table: each a step rule of one signature, its evaluations per step and whether
EDM's churn (Algorithm 2) may raise the noise level before its steps. A new solver is one function and one row.

A step rule step(denoise, x, t_cur, t_next, memory) -> (x_next, denoised) takes x at noise level t_cur (after any
churn) to t_next along the probability-flow ODE dx/dsigma = (x - D(x; sigma)) / sigma (EDM Eq. 4 with sigma(t) = t;
paper Eq. 153), where denoise(x, t) is D(x; t) in the sampler's dtype (guided or not, as the step's level says).
It returns x at t_next and its first evaluation, D(x; t_cur) (what the sampler's callback reports). The last step
ends at t_next = 0, where a rule evaluates once. memory is a dict the rule may keep between the steps of one run
(a multistep method's earlier evaluations); it starts empty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

Denoise = Callable[[torch.Tensor, float], torch.Tensor]
StepRule = Callable[[Denoise, torch.Tensor, float, float, dict], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Solver:
    """A solver's record: its step rule, its denoiser evaluations per step (the last step, to sigma = 0, evaluates
    once), whether churn applies, and a few words for the command lines' help."""

    step: StepRule
    evaluations_per_step: int
    churn: bool
    about: str


def euler_step(denoise: Denoise, x: torch.Tensor, t_cur: float, t_next: float, memory: dict) -> tuple:
    """Euler's method: one step along the slope at t_cur (EDM Algorithm 2 without the correction)."""
    denoised = denoise(x, t_cur)
    return x + (t_next - t_cur) * ((x - denoised) / t_cur), denoised


def heun_step(denoise: Denoise, x: torch.Tensor, t_cur: float, t_next: float, memory: dict) -> tuple:
    """Heun's 2nd-order method (EDM Algorithm 2, the release's): Euler's step corrected by the mean of the slopes at
    both ends, except on the step to sigma = 0."""
    denoised = denoise(x, t_cur)
    d_cur = (x - denoised) / t_cur
    x_next = x + (t_next - t_cur) * d_cur
    if t_next > 0:
        d_prime = (x_next - denoise(x_next, t_next)) / t_next
        x_next = x + (t_next - t_cur) * (0.5 * d_cur + 0.5 * d_prime)
    return x_next, denoised


def dpm2m_step(denoise: Denoise, x: torch.Tensor, t_cur: float, t_next: float, memory: dict) -> tuple:
    """DPM-Solver++(2M) (Lu et al. 2022, Algorithm 2) with the data prediction x_theta = D (EDM's denoiser: alpha_t = 1,
    sigma_t = t, so lambda_t = -log t); memory holds the previous step's denoised image and h."""
    d_cur = denoise(x, t_cur)
    if t_next == 0:
        # The step to sigma = 0 (lambda = inf) has factors 0 and 1: the solution is the denoised image.
        return d_cur, d_cur
    h = math.log(t_cur / t_next)  # h_i = lambda_{t_i} - lambda_{t_{i-1}}
    if "d_prev" not in memory:
        d = d_cur  # the first step is DPM-Solver++(1) (their Eq. 10 with one denoised image)
    else:
        # D_i = (1 + 1/(2 r_i)) x_theta(t_{i-1}) - 1/(2 r_i) x_theta(t_{i-2}), r_i = h_{i-1} / h_i
        half_over_r = 0.5 * h / memory["h_prev"]
        d = (1 + half_over_r) * d_cur - half_over_r * memory["d_prev"]
    memory.update(d_prev=d_cur, h_prev=h)
    # x_{t_i} = (sigma_{t_i} / sigma_{t_{i-1}}) x_{t_{i-1}} - alpha_{t_i} (e^{-h_i} - 1) D_i
    return (t_next / t_cur) * x - math.expm1(-h) * d, d_cur


# The solvers, all on the same noise levels (edm2.sampler.sigma_steps); heun is the release's. DPM-Solver++(2M)
# reuses the previous step's denoised image, which churn's fresh noise would make stale.
SOLVERS: dict[str, Solver] = {
    "heun": Solver(heun_step, evaluations_per_step=2, churn=True, about="the release's"),
    "euler": Solver(euler_step, evaluations_per_step=1, churn=True, about="1st order"),
    "dpm2m": Solver(dpm2m_step, evaluations_per_step=1, churn=False, about="DPM-Solver++(2M), Lu et al. 2022"),
}


def evaluations(solver: str, num_steps: int) -> int:
    """Denoiser evaluations (NFE) of num_steps steps of a solver: its evaluations per step, once on the last."""
    return SOLVERS[solver].evaluations_per_step * (num_steps - 1) + 1
