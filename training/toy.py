"""Training the toy example's denoiser on its 2-D ground truth (the autoguidance paper, Section 5.1 and Figure 1).

The recipe is the release's (toy_example.py): the network's score is fit to the ground truth's exact score at
log-normal noise levels (P_mean -2.3, P_std 1.5), weighted by sigma^2 (the denoising loss of EDM Eq. 2 written for
scores); Adam with betas (0.9, 0.99) at lr_ref / sqrt(max(t / lr_iter, 1)) (paper Eq. 67 with t in iterations);
and a power-function EMA of sigma_rel 0.010 (paper Eq. 127) whose snapshots are the trained models.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from edm2.loss import log_normal_sigma
from edm2.phema import PowerFunctionEMA
from edm2.toy.gmm import ground_truth
from edm2.toy.model import ToyDenoiser
from training.lr_schedule import learning_rate_schedule
from training.state import adam


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
    # Time is counted in iterations here: one "image" per iteration for the EMA (Eq. 127 with t_delta 1).
    ema = PowerFunctionEMA(net, stds=(opts.ema_std,))
    optimizer = adam(net.parameters(), device)
    for iteration in range(opts.iterations):
        # Eq. 67 without ramp-up; learning_rate_schedule counts images, iteration x batch of them.
        optimizer.param_groups[0]["lr"] = learning_rate_schedule(iteration * opts.batch_size, opts.batch_size,
                                                                 opts.lr_ref, opts.lr_iter, rampup_Mimg=0)
        sigma = log_normal_sigma([opts.batch_size], opts.P_mean, opts.P_std, device, generator)
        x = target.sample(opts.batch_size, sigma, generator=generator)
        loss = sigma**2 * (target.score(x, sigma) - net.score(x, sigma, graph=True)).square().mean(-1)
        optimizer.zero_grad(set_to_none=True)
        loss.mean().backward()
        optimizer.step()
        ema.update(cur_nimg=iteration + 1, batch_size=1)
        if opts.snapshot_due(iteration + 1):
            on_snapshot(iteration + 1, ema.emas[0])
    return ema.emas[0]
