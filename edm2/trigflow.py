"""An EDM-preconditioned network (edm2.networks.Precond) seen in TrigFlow, as edm2.consistency takes it: the model
F(x_t / sigma_d, t) = -F_EDM(x_t / sigma_d; c_noise), the adaptive weight's u(t) and the EDM denoiser.

The conversion is exact (edm2.consistency's docstring): with sigma = sigma_d tan t, EDM's c_in x_EDM is x_t / sigma_d,
so F is the family's network evaluated on the scaled input with the sign turned, and the same weights are a
diffusion model, a teacher, or a consistency model's student.
"""

from __future__ import annotations

from typing import Callable

import torch

from edm2.consistency import Denoiser, Model, t_to_sigma
from edm2.networks import Precond, network_guidance


def consistency_model(net: Precond, labels: torch.Tensor | None = None,
                      guidance: torch.Tensor | float | None = None) -> Model:
    """F(x_scaled, t) of net: -net.network(x_scaled, c_noise(sigma_d tan t), labels), computed in net's activation
    dtype and returned in its base dtype (float32, or float64 for a float64 network); guidance is the scale w of a
    network with a guidance embedding (sCD's student of a guided teacher)."""
    labels = net.prepare_labels(labels, next(net.parameters()).device)

    def model(x_scaled: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        base = net.base_dtype()
        dtype = net.compute_dtype(x_scaled.device)
        c_noise = net.noise_labels(t_to_sigma(t.to(base), net.sigma_data))
        return -net.network(x_scaled.to(dtype), c_noise, labels, **network_guidance(guidance)).to(base)

    return model


def adaptive_logvar(net: Precond) -> Callable[[torch.Tensor], torch.Tensor]:
    """u(t) [N] of net's log-variance head at TrigFlow times t [N] (Algorithm 1's w_phi = -u)."""
    return lambda t: net.logvar(t_to_sigma(t.to(net.base_dtype()), net.sigma_data))


def edm_denoiser(net: Precond, labels: torch.Tensor | None = None) -> Denoiser:
    """D(x, sigma) of net, as edm2.consistency takes a teacher."""
    return lambda x, sigma: net(x, sigma, labels)
