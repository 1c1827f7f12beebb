"""Sampling a consistency model in 1, 2 or N steps (Lu and Song, "Simplifying, Stabilizing and Scaling
Continuous-time Consistency Models", ICLR 2025, Section 2 and Appendix), on any EDM denoiser.

A consistency model's snapshot is an ordinary Precond snapshot (edm2.consistency's docstring): its consistency
function in TrigFlow, f(x_t, t) = cos(t) x_t - sin(t) sigma_d F(x_t / sigma_d, t), is its EDM denoiser at
x_EDM = x_t / cos(t), sigma = sigma_d tan(t). So the sampler takes a Precond, or any callable D(x, sigma, labels).

The steps, with z_i ~ N(0, I) per image:
- 1 step: x0 = f(sigma_d z_1, t_max), t_max = arctan(sigma_max / sigma_d) (sigma_max 80, as EDM's);
- 2 steps: then x = cos(t_mid) x0 + sin(t_mid) sigma_d z_2 and x0 = f(x, t_mid), t_mid = 1.1 (the paper's);
- N steps: the same at each time of cm_times: t_max, then the first N - 1 levels of EDM's schedule (EDM Eq. 5,
  rho = 7) of N levels from sigma_d tan(t_mid) down to sigma_min = 0.002, mapped by arctan. Its last level is
  left out, where f is the identity to within sigma_min; for N = 2 this is t_max, t_mid.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from edm2.layers import weights_normalized_once
from edm2.sampler import SamplerError
from edm2.schedules import sigma_steps

T_MID = 1.1  # the paper's second time of 2-step sampling
SIGMA_MAX = 80.0  # EDM's highest noise level: t_max = arctan(80 / sigma_d)
SIGMA_MIN = 0.002  # EDM's lowest noise level, the end of the N-step schedule
RHO = 7.0  # EDM Eq. 5's exponent of the N-step schedule
CONSISTENCY_KEY = "consistency"  # the snapshot metadata's record of a consistency model


def is_consistency_model(metadata: object) -> bool:
    """Whether a snapshot's metadata records a consistency model (its key 'consistency' holds a dict)."""
    return isinstance(metadata, dict) and isinstance(metadata.get(CONSISTENCY_KEY), dict)


def default_t_max(sigma_max: float, sigma_data: float) -> float:
    """t_max = arctan(sigma_max / sigma_d), the time of the first step."""
    return math.atan(sigma_max / sigma_data)


def check_cm_settings(steps: int, t_mid: float, t_max: float) -> None:
    """Raise SamplerError (one line naming the setting) unless steps >= 1, 0 < t_max < pi/2 and 0 < t_mid < t_max."""
    if type(steps) is not int or steps < 1:
        raise SamplerError(f"steps={steps}: a consistency model needs at least one step")
    if not (isinstance(t_max, (int, float)) and 0 < t_max < math.pi / 2):
        raise SamplerError(f"t_max={t_max}: expected a time in (0, pi/2)")
    if not (isinstance(t_mid, (int, float)) and 0 < t_mid < t_max):
        value = f"{t_mid:g}" if isinstance(t_mid, (int, float)) else repr(t_mid)
        raise SamplerError(f"t_mid={value}: expected a time in (0, t_max) = (0, {t_max:.6g})")


def cm_times(steps: int, t_max: float, t_mid: float, sigma_data: float) -> list[float]:
    """The TrigFlow times of the steps (the module's docstring): t_max, then for N >= 2 steps the first N - 1 levels of
    EDM's N-level schedule from sigma_d tan(t_mid) to SIGMA_MIN, mapped by arctan (t_max, t_mid for two)."""
    check_cm_settings(steps, t_mid, t_max)
    if steps == 1:
        return [t_max]
    sigmas = sigma_steps(steps, SIGMA_MIN, sigma_data * math.tan(t_mid), RHO)[: steps - 1]
    return [t_max, *torch.atan(sigmas / sigma_data).tolist()]


def consistency_sample(
    net: Callable,
    noise: torch.Tensor,
    labels: torch.Tensor | None = None,
    steps: int = 2,
    t_max: float | None = None,
    t_mid: float = T_MID,
    sigma_max: float = SIGMA_MAX,
    randn_like: Callable[[torch.Tensor], torch.Tensor] = torch.randn_like,
    sigma_data: float | None = None,
    guidance_scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Samples of the consistency model net from unit noise [N,C,H,W] in `steps` steps (the module's docstring).

    net is a Precond or any EDM denoiser D(x, sigma, labels) (then give sigma_data unless it has the attribute);
    t_max defaults to arctan(sigma_max / sigma_d). randn_like draws the fresh noise of every step after the first
    (edm2.procedures.generation.SeededRandom.randn_like: per image, so that an image depends on its seed alone).
    guidance_scale is the scale w that a network with a guidance embedding takes (Precond.forward's guidance; a
    student of a guided teacher). No gradients are recorded.
    """
    sigma_data = getattr(net, "sigma_data", None) if sigma_data is None else sigma_data
    if not isinstance(sigma_data, (int, float)) or not sigma_data > 0:
        raise SamplerError(f"sigma_data={sigma_data}: give the denoiser's positive sigma_data")
    t_max = default_t_max(sigma_max, sigma_data) if t_max is None else t_max
    times = cm_times(steps, t_max, t_mid, sigma_data)
    extra = {} if guidance_scale is None else {"guidance": guidance_scale}
    count = noise.shape[0]
    with weights_normalized_once(net):
        x = sigma_data * noise.to(dtype)
        x0 = x
        for i, t in enumerate(times):
            if i:
                x = math.cos(t) * x0 + math.sin(t) * sigma_data * randn_like(x0)
            sigma = torch.full([count], sigma_data * math.tan(t), dtype=dtype, device=noise.device)
            x0 = net(x / math.cos(t), sigma, labels, **extra).to(dtype)
    return x0
