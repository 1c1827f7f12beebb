"""The EDM2 training loss: uncertainty-weighted denoising error (paper Eq. 21)."""

from __future__ import annotations

from typing import Sequence

import torch


def log_normal_sigma(shape: Sequence[int], P_mean: float, P_std: float, device: torch.device | str = "cpu",
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Noise levels of the training distribution, ln(sigma) ~ N(P_mean, P_std^2) (Eq. 16), drawn from generator
    (default: torch's global one)."""
    return (torch.randn(shape, device=device, generator=generator) * P_std + P_mean).exp()


class EDM2Loss:
    """Per-element loss lambda(sigma)/e^u(sigma) * |D(y+n; sigma) - y|^2 + u(sigma) (Eq. 21)."""

    def __init__(self, P_mean: float = -0.4, P_std: float = 1.0, sigma_data: float = 0.5):
        self.P_mean = P_mean
        self.P_std = P_std
        self.sigma_data = sigma_data

    def sample_sigma(self, batch_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Noise levels with ln(sigma) ~ N(P_mean, P_std^2) (Eq. 16), shape [N,1,1,1]."""
        return log_normal_sigma([batch_size, 1, 1, 1], self.P_mean, self.P_std, device)

    def weight(self, sigma: torch.Tensor) -> torch.Tensor:
        """lambda(sigma) of Eq. 15."""
        sd = self.sigma_data
        return (sigma**2 + sd**2) / (sigma * sd) ** 2

    def __call__(
        self,
        net: torch.nn.Module,
        images: torch.Tensor,
        labels: torch.Tensor | None = None,
        sigma: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss per element of images [N,C,H,W]; sigma [N,1,1,1] and unit noise are drawn unless given."""
        if sigma is None:
            sigma = self.sample_sigma(images.shape[0], images.device)
        if noise is None:
            noise = torch.randn_like(images)
        denoised, logvar = net(images + noise * sigma, sigma, labels, return_logvar=True)
        # Eq. 21: the single-sample estimate of Eq. 13 weighted by lambda(sigma) / e^u, plus u.
        return self.weight(sigma) / logvar.exp() * (denoised - images).square() + logvar

