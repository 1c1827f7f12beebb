"""The toy example's denoiser: a small magnitude-preserving MLP that models log p(x; sigma) of 2-D points, its score
by automatic differentiation, and edm2.sampler's ODE for 2-D points with every step kept for plotting.

The network mirrors the release's ToyModel (toy_example.py; the autoguidance paper, Section 5.1): the input
(c_in x, log(sigma) / 4, 1) goes through MP linear layers with MP SiLU between them, and the output's mean square,
times a learned gain and divided by sigma, minus |c_in x|^2 / 2 is the log density. Its state-dict names are the
release's (layers.0.weight, layers.2.weight, ..., gain), so the release's toy pickles load into it.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from edm2.layers import mp_silu, normalize
from edm2.network_args import check_toy
from edm2.sampler import edm_sampler


class MPLinear(torch.nn.Module):
    """Linear layer with forced weight normalization (paper Eq. 66) and unit-magnitude output (Eq. 47)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_dim, in_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w^T with w's rows normalized to norm 1 / sqrt(fan_in)."""
        if self.training:
            with torch.no_grad():
                self.weight.copy_(normalize(self.weight))
        return x @ (normalize(self.weight) / math.sqrt(self.weight.shape[1])).t()


class MPSiLU(torch.nn.Module):
    """SiLU scaled to unit output magnitude (Eq. 81), as a module so that the layers form one Sequential."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """mp_silu(x)."""
        return mp_silu(x)


class ToyDenoiser(torch.nn.Module):
    """An MLP model of the unnormalized log density of noisy 2-D points; its gradient is the score."""

    def __init__(self, in_dim: int = 2, num_layers: int = 4, hidden_dim: int = 64, sigma_data: float = 0.5):
        super().__init__()
        check_toy(in_dim, num_layers, hidden_dim, sigma_data)
        self.init_kwargs = dict(in_dim=in_dim, num_layers=num_layers, hidden_dim=hidden_dim, sigma_data=sigma_data)
        self.sigma_data = sigma_data
        layers = [MPLinear(in_dim + 2, hidden_dim)]  # inputs: c_in x, c_noise and a constant 1
        for _ in range(num_layers):
            layers += [MPSiLU(), MPLinear(hidden_dim, hidden_dim)]
        self.layers = torch.nn.Sequential(*layers)
        self.gain = torch.nn.Parameter(torch.zeros([]))

    def forward(self, x: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
        """log p(x; sigma) up to a constant, for points x [..., 2] and noise levels broadcastable to x[..., 0]."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).broadcast_to(x.shape[:-1])[..., None]
        x = x / (self.sigma_data**2 + sigma**2).sqrt()
        y = self.layers(torch.cat([x, sigma.log() / 4, torch.ones_like(sigma)], dim=-1))
        # The learned part scales like 1 / sigma; the Gaussian term makes the model the prior N(0, sigma_data^2 +
        # sigma^2) while the gain is 0, as at initialization.
        return y.square().mean(-1) * self.gain / sigma[..., 0] - 0.5 * x.square().sum(-1)

    def logp(self, x: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
        """log p(x; sigma) up to a constant (the same as calling the network)."""
        return self(x, sigma)

    def score(self, x: torch.Tensor, sigma: float | torch.Tensor, graph: bool = False) -> torch.Tensor:
        """grad_x log p(x; sigma); with graph, differentiable again (for training on the score)."""
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            return torch.autograd.grad(self.logp(x, sigma).sum(), x, create_graph=graph)[0]


def denoiser(model) -> Callable[[torch.Tensor, torch.Tensor, None], torch.Tensor]:
    """model's denoiser D(x; sigma) = x + sigma^2 score(x; sigma) (EDM Eq. 3), called as edm2.sampler calls a network
    (points [n, 2], noise levels [n], labels unused); model has score(x, sigma)."""

    def denoise(x: torch.Tensor, sigma: torch.Tensor, labels: None) -> torch.Tensor:
        return x + sigma[:, None] ** 2 * model.score(x, sigma)

    return denoise


def sample_trajectories(net, x_init: torch.Tensor, sigma_max: float, gnet=None, guidance: float = 1.0,
                        num_steps: int = 32, sigma_min: float = 0.002, rho: float = 7) -> torch.Tensor:
    """Every step's points [num_steps + 1, n, 2] of edm2.sampler's Heun sampler from x_init at sigma_max down to 0,
    for net guided by gnet with weight guidance (paper Eq. 152); net and gnet have score(x, sigma)."""
    points = []
    # The sampler starts from noise * sigma_max: x_init / sigma_max is that noise up to one rounding.
    last = edm_sampler(denoiser(net), x_init / sigma_max, gnet=None if gnet is None else denoiser(gnet),
                       guidance=guidance, num_steps=num_steps, sigma_min=sigma_min, sigma_max=sigma_max, rho=rho,
                       dtype=x_init.dtype, callback=lambda step: points.append(step["x"]))
    return torch.stack([*points, last]).detach()
