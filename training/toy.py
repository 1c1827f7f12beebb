"""Training the toy example's denoiser on its 2-D ground truth (the autoguidance paper, Section 5.1 and Figure 1).

The recipe is the release's (toy_example.py): the network's score is fit to the ground truth's exact score at
log-normal noise levels (P_mean -2.3, P_std 1.5), weighted by sigma^2 (the denoising loss of EDM Eq. 2 written for
scores); Adam with betas (0.9, 0.99) at lr_ref / sqrt(max(t / lr_iter, 1)) (paper Eq. 67 with t in iterations);
and a power-function EMA of sigma_rel 0.010 (paper Eq. 127) whose snapshots are the trained models.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import numpy as np
import torch

from edm2.phema import power_function_beta
from edm2.toy_gmm import ground_truth
from edm2.toy_model import ToyDenoiser


@dataclasses.dataclass(frozen=True)
class ToyTraining:
    """One toy training run; the defaults are the release's."""

    classes: str = "A"
    num_layers: int = 4
    hidden_dim: int = 64
    iterations: int = 4096
    batch_size: int = 4096
    seed: int = 0
    P_mean: float = -2.3
    P_std: float = 1.5
    sigma_data: float = 0.5
    lr_ref: float = 1e-2
    lr_iter: int = 512
    ema_std: float = 0.010
    snapshot_iter: int = 256

    def snapshot_due(self, iteration: int) -> bool:
        """Whether the EMA is saved after this many iterations: every snapshot_iter, and at the end."""
        return iteration % self.snapshot_iter == 0 or iteration == self.iterations


def train_toy(opts: ToyTraining, device: torch.device,
              on_snapshot: Callable[[int, ToyDenoiser], None]) -> ToyDenoiser:
    """Train as opts says, calling on_snapshot(iterations done, EMA network) when a snapshot is due; returns the EMA."""
    torch.manual_seed(opts.seed)
    generator = torch.Generator(device).manual_seed(opts.seed)
    target = ground_truth(opts.classes, device)
    net = ToyDenoiser(num_layers=opts.num_layers, hidden_dim=opts.hidden_dim, sigma_data=opts.sigma_data)
    net = net.to(device).train().requires_grad_(True)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    optimizer = torch.optim.Adam(net.parameters(), betas=(0.9, 0.99))
    for iteration in range(opts.iterations):
        optimizer.param_groups[0]["lr"] = opts.lr_ref / np.sqrt(max(iteration / opts.lr_iter, 1))
        sigma = (torch.randn(opts.batch_size, device=device, generator=generator) * opts.P_std + opts.P_mean).exp()
        x = target.sample(opts.batch_size, sigma, generator=generator)
        loss = sigma**2 * (target.score(x, sigma) - net.score(x, sigma, graph=True)).square().mean(-1)
        optimizer.zero_grad(set_to_none=True)
        loss.mean().backward()
        optimizer.step()
        beta = power_function_beta(std=opts.ema_std, t_next=iteration + 1, t_delta=1)
        with torch.no_grad():
            for p_net, p_ema in zip(net.parameters(), ema.parameters()):
                p_ema.lerp_(p_net.detach(), 1 - beta)
        if opts.snapshot_due(iteration + 1):
            on_snapshot(iteration + 1, ema)
    return ema
