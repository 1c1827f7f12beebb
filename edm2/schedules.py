"""The sampler's time discretizations, one table: each a function (num_steps, sigma_min, sigma_max, rho) -> the noise
levels t_0 = sigma_max > ... > t_{N-1} = sigma_min followed by t_N = 0, in float64, and a few words for the command
lines' help. The solvers (edm2.solvers) step between whichever levels the schedule gives, as k-diffusion keeps its
get_sigmas_* apart from its sample_*. A new schedule is one function and one row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

Levels = Callable[[int, float, float, float], torch.Tensor]
# EDM Table 1's smallest VP time step eps_s (Song et al. 2021 sample the VP SDE down to t = 1e-3).
VP_EPSILON_S = 1e-3


@dataclass(frozen=True)
class Schedule:
    """A schedule's record: its levels function and a few words for the command lines' help."""

    levels: Levels
    about: str


def ramp(num_steps: int) -> torch.Tensor:
    """i / (N - 1) for i = 0, ..., N - 1 in float64: 0 to 1 in equal steps (0 alone for one step)."""
    return torch.arange(num_steps, dtype=torch.float64) / max(num_steps - 1, 1)


def then_zero(t: torch.Tensor) -> torch.Tensor:
    """The levels t followed by t_N = 0, where every sampler ends."""
    return torch.cat([t, torch.zeros(1, dtype=torch.float64)])


def sigma_steps(num_steps: int, sigma_min: float, sigma_max: float, rho: float) -> torch.Tensor:
    """Noise levels t_0 > ... > t_{N-1} of EDM Eq. 5 followed by t_N = 0, in float64."""
    top, bottom = sigma_max ** (1 / rho), sigma_min ** (1 / rho)
    return then_zero((top + ramp(num_steps) * (bottom - top)) ** rho)


def exponential_steps(num_steps: int, sigma_min: float, sigma_max: float, rho: float) -> torch.Tensor:
    """Levels uniform in log sigma, so in log-SNR (SNR = 1 / sigma^2 at EDM's unit scale), followed by 0: a constant
    ratio (sigma_min / sigma_max)^(1 / (N - 1)) between neighbours (k-diffusion's get_sigmas_exponential); rho is
    not used."""
    return then_zero(sigma_max * (sigma_min / sigma_max) ** ramp(num_steps))


def vp_steps(num_steps: int, sigma_min: float, sigma_max: float, rho: float) -> torch.Tensor:
    """The VP time steps of EDM Table 1 (Song et al. 2021), followed by 0: t_i = 1 + i / (N - 1) (eps_s - 1) and
    sigma(t) = sqrt(e^(beta_d t^2 / 2 + beta_min t) - 1), with beta_d and beta_min such that sigma(1) = sigma_max and
    sigma(eps_s) = sigma_min (as EDM's ablation sampler fits them); rho is not used."""
    a, b, eps = math.log1p(sigma_max**2), math.log1p(sigma_min**2), VP_EPSILON_S
    # log(1 + sigma^2) = beta_d t^2 / 2 + beta_min t at t = 1 (a) and t = eps_s (b), solved for beta_d, beta_min.
    beta_d = 2 * (b / eps - a) / (eps - 1)
    beta_min = a - beta_d / 2
    t = 1 + ramp(num_steps) * (eps - 1)
    return then_zero(torch.expm1(beta_d * t**2 / 2 + beta_min * t).sqrt())


# The schedules; edm is the release's (EDM Eq. 5 with rho = 7: the steps crowd towards sigma_min as rho grows).
SCHEDULES: dict[str, Schedule] = {
    "edm": Schedule(sigma_steps, about="EDM Eq. 5 with exponent rho, the release's"),
    "exponential": Schedule(exponential_steps, about="uniform in log sigma, i.e. in log-SNR"),
    "vp": Schedule(vp_steps, about="EDM Table 1's VP time steps, Song et al. 2021"),
}
