"""The toy example's consistency model (sCM, Lu and Song 2025, on the autoguidance paper's 2-D example): a small
magnitude-preserving MLP F(x_t / sigma_d, t) in TrigFlow with its adaptive log-variance head u(t), its consistency
function, and its 1-, 2- and N-step sampler.

The teacher (edm2.toy.model.ToyDenoiser) models log p and has no direct output, so the student is its own network:
the inputs (x_t / sigma_d, c_noise = t, 1) go through MP linear layers with MP SiLU between them, as the teacher's,
and a last one to the two outputs times a learned gain (0 at initialization, so F starts at 0). The layers are the
image networks' MPConv (kernel []), which never write their weights in a forward pass (the teacher's MPLinear does,
and torch.func.jvp refuses that): training applies forced weight normalization (paper Eq. 66) before each step.
The consistency function f(x_t, t) = cos(t) x_t - sin(t) sigma_d F(x_t / sigma_d, t) is edm2.consistency's.

The sampler below follows the convention the image networks' consistency sampling shares (t_max from
sigma_max = 80, t_mid = 1.1).

Sampling follows the sCM paper: one step x0 = f(sigma_d z, t_max) with t_max = arctan(sigma_max / sigma_d); two
steps then x = cos(t_mid) x0 + sin(t_mid) sigma_d z', x0 = f(x, t_mid) with t_mid = 1.1; N >= 3 steps the same
at t_max and the EDM schedule's N - 1 lower levels (EDM Eq. 5, rho 7) mapped by t = arctan(sigma / sigma_d).
"""

from __future__ import annotations

import math

import torch

from edm2.consistency_sampler import T_MID, cm_times
from edm2.layers import MPConv, MPFourier
from edm2.network_args import MAX_CHANNELS, check_toy, integer
from edm2.toy.gmm import ToyError
from edm2.toy.model import MPSiLU

SIGMA_MAX = 80.0  # EDM's largest noise level, where sampling starts


class ToyFlow(torch.nn.Module):
    """F(x_t / sigma_d, t) of 2-D points as an MP MLP, and u(t) of the adaptive weight (MPFourier and MPLinear, as
    edm2.networks.Precond's log-variance head); every linear layer an MPConv."""

    def __init__(self, in_dim: int = 2, num_layers: int = 4, hidden_dim: int = 64, sigma_data: float = 0.5,
                 logvar_channels: int = 32):
        super().__init__()
        check_toy(in_dim, num_layers, hidden_dim, sigma_data)
        integer("logvar_channels", logvar_channels, 1, MAX_CHANNELS)
        self.init_kwargs = dict(in_dim=in_dim, num_layers=num_layers, hidden_dim=hidden_dim, sigma_data=sigma_data,
                                logvar_channels=logvar_channels)
        self.sigma_data = sigma_data
        layers = [MPConv(in_dim + 2, hidden_dim, [])]  # inputs: x_t / sigma_d, c_noise = t and a constant 1
        for _ in range(num_layers):
            layers += [MPSiLU(), MPConv(hidden_dim, hidden_dim, [])]
        self.layers = torch.nn.Sequential(*layers, MPSiLU(), MPConv(hidden_dim, in_dim, []))
        self.gain = torch.nn.Parameter(torch.zeros([]))
        self.logvar_fourier = MPFourier(logvar_channels)
        self.logvar_linear = MPConv(logvar_channels, 1, [])

    def forward(self, x_scaled: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """F for points x_scaled = x_t / sigma_d [n, 2] at TrigFlow times t [n] (or one time for all)."""
        t = torch.as_tensor(t, dtype=x_scaled.dtype, device=x_scaled.device).broadcast_to(x_scaled.shape[:-1])
        return self.layers(torch.cat([x_scaled, t[..., None], torch.ones_like(t)[..., None]], dim=-1)) * self.gain

    def logvar(self, t: torch.Tensor) -> torch.Tensor:
        """u(t) [n] at TrigFlow times t [n] (Algorithm 1's w_phi = -u)."""
        return self.logvar_linear(self.logvar_fourier(t)).flatten()

    def consistency_function(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """f(x_t, t) = cos(t) x_t - sin(t) sigma_d F(x_t / sigma_d, t): the predicted clean points."""
        t = torch.as_tensor(t, dtype=x_t.dtype, device=x_t.device).broadcast_to(x_t.shape[:-1])
        return torch.cos(t)[..., None] * x_t - torch.sin(t)[..., None] * self.sigma_data * self(
            x_t / self.sigma_data, t)


def sampling_times(num_steps: int, sigma_data: float, sigma_max: float = SIGMA_MAX) -> list[float]:
    """The TrigFlow times of num_steps consistency steps, as the images' sampler takes them
    (edm2.consistency_sampler.cm_times): t_max = arctan(sigma_max / sigma_d), then t_mid = 1.1 and, for three or more,
    EDM's schedule below it mapped by arctan."""
    if type(num_steps) is not int or num_steps < 1:
        raise ToyError(f"a consistency model samples in 1 or more steps, not {num_steps!r}")
    return cm_times(num_steps, math.atan(sigma_max / sigma_data), T_MID, sigma_data)


@torch.no_grad()
def consistency_sample(net: ToyFlow, noise: torch.Tensor, sigma_max: float = SIGMA_MAX) -> torch.Tensor:
    """Points [n, 2] after noise.shape[0] consistency steps from standard normal noise [steps, n, 2]: x0 =
    f(sigma_d z_0, t_0), then x0 = f(cos(t_i) x0 + sin(t_i) sigma_d z_i, t_i)."""
    times = sampling_times(noise.shape[0], net.sigma_data, sigma_max)
    x0 = net.consistency_function(net.sigma_data * noise[0], times[0])
    for t, z in zip(times[1:], noise[1:]):
        x0 = net.consistency_function(math.cos(t) * x0 + math.sin(t) * net.sigma_data * z, t)
    return x0
