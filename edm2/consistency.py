"""Continuous-time consistency models in TrigFlow (Lu and Song, "Simplifying, Stabilizing and Scaling
Continuous-time Consistency Models", ICLR 2025): the map from EDM, the tangents of consistency training (sCT) and
distillation (sCD), the JVP rearrangement, tangent normalization and warmup, and the adaptively weighted loss of
the paper's Algorithm 1.

TrigFlow noises data x0 of standard deviation sigma_d as x_t = cos(t) x0 + sin(t) z, z ~ N(0, sigma_d^2 I),
t in [0, pi/2], and a model is F(x_t / sigma_d, t): the denoiser is D(x_t, t) = cos(t) x_t - sin(t) sigma_d F and the
probability-flow ODE dx_t/dt = sigma_d F. From EDM, sigma = sigma_d tan(t) and x_EDM = x_t / cos(t); then EDM's
preconditioning (EDM Eq. 7) has c_skip = cos^2 t, c_out = sigma_d sin t and c_in x_EDM = x_t / sigma_d, so an EDM
denoiser D(x; sigma) = c_skip x + c_out F_EDM(c_in x) is TrigFlow's with F = -F_EDM, and a consistency function
f(x_t, t) = cos(t) x_t - sin(t) sigma_d F(x_t / sigma_d, t) is an EDM denoiser of the same network.

Everything here works on callables, so that the 2-D toy and the image networks share it: a model
F(x_scaled, t) -> tensor like x_scaled, with t of shape [N]; an EDM denoiser D(x, sigma) -> tensor like x, with
sigma of shape [N]; and the adaptive weight's log-variance u(t) -> [N] (Algorithm 1's w_phi = -u). The arithmetic of
tangents and loss is in the dtype of x0 (float32 or float64), whatever the model computes in.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from edm2.loss import learned_uncertainty, log_normal_sigma

Model = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Denoiser = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
TANGENT_CONSTANT = 0.1  # c of the tangent normalization g / (||g|| + c) (the paper's Section 4.2)


def per_sample(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """t [N] shaped to broadcast against x [N, ...]."""
    return t.reshape(-1, *[1] * (x.ndim - 1))


def sigma_to_t(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """TrigFlow time of an EDM noise level: t = arctan(sigma / sigma_d)."""
    return torch.atan(sigma / sigma_data)


def t_to_sigma(t: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """EDM noise level of a TrigFlow time: sigma = sigma_d tan(t)."""
    return sigma_data * torch.tan(t)


def sample_t(shape: Sequence[int], P_mean: float, P_std: float, sigma_data: float,
             device: torch.device | str = "cpu", generator: torch.Generator | None = None) -> torch.Tensor:
    """Training times of the proposal distribution: ln(sigma_d tan t) ~ N(P_mean, P_std^2) (Algorithm 1)."""
    return sigma_to_t(log_normal_sigma(shape, P_mean, P_std, device, generator), sigma_data)


def noised(x0: torch.Tensor, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = cos(t) x0 + sin(t) z, z of standard deviation sigma_d."""
    t = per_sample(t, x0)
    return torch.cos(t) * x0 + torch.sin(t) * z


def sct_tangent(x0: torch.Tensor, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Consistency training's tangent dx_t/dt = cos(t) z - sin(t) x0: the derivative of noised() in t."""
    t = per_sample(t, x0)
    return torch.cos(t) * z - torch.sin(t) * x0


def denoiser_velocity(denoise: Denoiser, x_t: torch.Tensor, t: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """Distillation's tangent sigma_d F_teacher(x_t / sigma_d, t) = (cos(t) x_t - D(x_t / cos t; sigma_d tan t)) /
    sin(t) from an EDM denoiser D: the teacher's probability-flow ODE at x_t."""
    tb = per_sample(t, x_t)
    denoised = denoise(x_t / torch.cos(tb), t_to_sigma(t, sigma_data)).to(x_t.dtype)
    return (torch.cos(tb) * x_t - denoised) / torch.sin(tb)


def rearranged_jvp(model: Model, x_t: torch.Tensor, t: torch.Tensor, tangent: torch.Tensor,
                   sigma_data: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(F(x_t / sigma_d, t), cos(t) sin(t) dF/dt) along dx_t/dt = tangent, by one torch.func.jvp with the primals
    (x_t / sigma_d, t) and the tangents (cos(t) sin(t) tangent / sigma_d, cos(t) sin(t)): the paper's rearrangement,
    whose tangent stays of order one in 16-bit arithmetic where dF/dt itself grows like 1 / t. Both in x_t's dtype."""
    scale = torch.cos(t) * torch.sin(t)
    primal, derivative = torch.func.jvp(
        model, (x_t / sigma_data, t), (per_sample(scale, x_t) * tangent / sigma_data, scale))
    return primal.to(x_t.dtype), derivative.to(x_t.dtype)


def consistency_tangent(F_minus: torch.Tensor, scaled_dF_dt: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                        tangent: torch.Tensor, r: float, sigma_data: float) -> torch.Tensor:
    """Algorithm 1's g = -cos^2(t) (sigma_d F- - dx_t/dt) - r cos(t) sin(t) (x_t + sigma_d dF-/dt), from
    scaled_dF_dt = cos(t) sin(t) dF-/dt (rearranged_jvp) and the tangent warmup r in [0, 1]."""
    tb = per_sample(t, x_t)
    cos, sin = torch.cos(tb), torch.sin(tb)
    return -cos.square() * (sigma_data * F_minus - tangent) - r * (cos * sin * x_t + sigma_data * scaled_dF_dt)


def normalize_tangent(g: torch.Tensor, c: float = TANGENT_CONSTANT) -> torch.Tensor:
    """g / (||g|| + c) per sample, ||g|| the root mean square over its elements (a norm that does not grow with the
    image size)."""
    rms = g.flatten(1).square().mean(1).sqrt()
    return g / (per_sample(rms, g) + c)


def tangent_warmup(nimg: int, warmup_nimg: int) -> float:
    """r = min(1, images seen / warmup images), 1 without warmup (Algorithm 1's tangent warmup)."""
    return 1.0 if warmup_nimg <= 0 else min(1.0, nimg / warmup_nimg)


def prior_weight(t: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """The adaptive weight's prior 1 / (sigma_d tan t) (the paper's Section 4.3)."""
    return 1 / (sigma_data * torch.tan(t))


def consistency_objective(F: torch.Tensor, F_minus: torch.Tensor, g: torch.Tensor, logvar: torch.Tensor,
                          t: torch.Tensor, sigma_data: float, prior: bool = True) -> torch.Tensor:
    """Per element, w(t) / e^u(t) (F - F- - g)^2 + u(t): Algorithm 1's e^w_phi / D ||F - F- - g||^2 - w_phi with
    w_phi = -u, averaged over the D elements, times the prior 1 / (sigma_d tan t) (or 1 without prior)."""
    weight = prior_weight(per_sample(t, F), sigma_data) if prior else torch.ones_like(per_sample(t, F))
    return learned_uncertainty(weight, (F - F_minus - g).square(), per_sample(logvar, F))


def algorithm1_loss(model: Model, logvar: Callable[[torch.Tensor], torch.Tensor], x0: torch.Tensor,
                    z: torch.Tensor, t: torch.Tensor, tangent: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
                    r: float, sigma_data: float, seed: int, c: float = TANGENT_CONSTANT,
                    prior: bool = True, grad_model: Model | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-element loss, per-sample ||g|| before normalization) of Algorithm 1 at x_t = noised(x0, z, t): the JVP
    without a graph, then F with one, both after reseeding torch's generators with seed so that dropout draws the
    same masks in both passes. tangent is dx_t/dt, or a function of x_t giving it (the teacher, for sCD).
    grad_model: the same model for the pass with a graph (e.g. through a DistributedDataParallel wrapper, which
    forward-mode AD cannot go through); model by default."""
    x_t = noised(x0, z, t)
    if callable(tangent):
        with torch.no_grad():
            tangent = tangent(x_t)
    tangent = tangent.to(x0.dtype)
    devices = [x0.device] if x0.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        F_minus, scaled_dF_dt = rearranged_jvp(model, x_t, t, tangent, sigma_data)
    g = consistency_tangent(F_minus, scaled_dF_dt, x_t, t, tangent, r, sigma_data)
    norm = g.flatten(1).square().mean(1).sqrt()
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        F = (grad_model or model)(x_t / sigma_data, t).to(x0.dtype)
    loss = consistency_objective(F, F_minus, normalize_tangent(g, c), logvar(t).to(x0.dtype), t, sigma_data, prior)
    return loss, norm
