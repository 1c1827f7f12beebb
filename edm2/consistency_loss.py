"""The training loss of a continuous-time consistency model (Lu and Song, ICLR 2025, Algorithm 1) on an EDM2
Precond, called as a training step calls EDM2Loss: consistency training (sCT, the tangent of the noising itself) or
distillation (sCD, the teacher's probability-flow ODE). It keeps, on the device, what the stats rows report: the
tangent's norm ||g|| before normalization, the gradient norm, and the adaptive weight's u(t) per bin of t."""

from __future__ import annotations

import math

import torch

from edm2.consistency import (TANGENT_CONSTANT, algorithm1_loss, denoiser_velocity, sample_t, sct_tangent,
                              tangent_warmup)
from edm2.errors import EDM2Error
from edm2.networks import Precond
from edm2.trigflow import adaptive_logvar, consistency_model, edm_denoiser

METHODS = ("sct", "scd")  # consistency training, consistency distillation
T_BINS = 8  # bins of equal width over t in [0, pi/2] for u(t) in the stats rows
# Positions in ConsistencyLoss.stats: sum of ||g|| and its sample count, sum of gradient norms and their step count,
# then u(t)'s sum and draw count per t-bin.
G_SUM, G_COUNT, GRAD_SUM, GRAD_COUNT, U_SUMS = 0, 1, 2, 3, 4
U_COUNTS = U_SUMS + T_BINS


class ConsistencyLossError(EDM2Error):
    """A consistency loss that cannot be built: an unknown method, or distillation without a teacher."""


class TrigFlowView(torch.nn.Module):
    """A Precond's TrigFlow model F(x_scaled, t; labels) as a module's forward, so that DistributedDataParallel can
    wrap it for the pass with a graph (forward-mode AD runs on the bare network)."""

    def __init__(self, net: Precond):
        super().__init__()
        self.net = net

    def forward(self, x_scaled: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """F(x_scaled, t) of edm2.trigflow.consistency_model."""
        return consistency_model(self.net, labels)(x_scaled, t)


def bare_network(net: torch.nn.Module) -> Precond:
    """The Precond inside a DistributedDataParallel(TrigFlowView(net)), or net itself."""
    inner = getattr(net, "module", net)
    return inner.net if isinstance(inner, TrigFlowView) else inner


class ConsistencyLoss:
    """Per-element loss of Algorithm 1 (edm2.consistency.algorithm1_loss) at times drawn from the proposal
    ln(sigma_d tan t) ~ N(P_mean, P_std^2), with the tangent warmup r over the images seen (set_images before each
    call), for method sct or scd (teacher: the EDM2 Precond whose ODE is distilled, in eval mode)."""

    def __init__(self, method: str, P_mean: float, P_std: float, sigma_data: float, tangent_warmup_nimg: int,
                 c: float = TANGENT_CONSTANT, prior: bool = True, teacher: Precond | None = None,
                 teacher_name: str | None = None):
        if method not in METHODS:
            raise ConsistencyLossError(f"consistency method {method!r} is not one of {', '.join(METHODS)}")
        if method == "scd" and teacher is None and teacher_name is None:
            raise ConsistencyLossError("consistency distillation (scd) needs a teacher")
        self.method, self.P_mean, self.P_std, self.sigma_data = method, P_mean, P_std, sigma_data
        self.tangent_warmup_nimg, self.c, self.prior = tangent_warmup_nimg, c, prior
        self.teacher, self.teacher_name = teacher, teacher_name
        self.nimg = 0
        self.stats = torch.zeros([U_COUNTS + T_BINS], dtype=torch.float64)

    def to(self, device: torch.device) -> ConsistencyLoss:
        """This loss with its teacher and statistics on device."""
        if self.teacher is not None:
            self.teacher = self.teacher.to(device).eval().requires_grad_(False)
        self.stats = self.stats.to(device)
        return self

    def record(self) -> dict:
        """The snapshot metadata's `consistency` record of a model trained with this loss."""
        return dict(method=self.method, sigma_data=self.sigma_data, teacher=self.teacher_name, P_mean=self.P_mean,
                    P_std=self.P_std, tangent_warmup_nimg=self.tangent_warmup_nimg, c=self.c, prior=self.prior)

    def set_images(self, nimg: int) -> None:
        """The images seen before the next call: the tangent warmup's r = min(1, nimg / warmup)."""
        self.nimg = nimg

    def __call__(self, net: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Loss per element of images [N,C,H,W] for net (a Precond, or DistributedDataParallel(TrigFlowView)), its
        draws (t, z, the dropout seed) from torch's generators."""
        bare = bare_network(net)
        t = sample_t([images.shape[0]], self.P_mean, self.P_std, self.sigma_data, images.device)
        z = torch.randn_like(images) * self.sigma_data
        seed = int(torch.randint(1 << 62, []))  # from the round's seed: the same masks on resume
        if self.method == "sct":
            tangent = sct_tangent(images, z, t)
        else:
            teacher = edm_denoiser(self.teacher, labels)
            tangent = lambda x_t: denoiser_velocity(teacher, x_t, t, self.sigma_data)  # noqa: E731
        grad_model = None if bare is net else (lambda x_scaled, times: net(x_scaled, times, labels))
        logvar = adaptive_logvar(bare)
        loss, norm = algorithm1_loss(consistency_model(bare, labels), logvar, images, z, t, tangent,
                                     tangent_warmup(self.nimg, self.tangent_warmup_nimg), self.sigma_data, seed,
                                     self.c, self.prior, grad_model)
        self._keep(t, norm.detach(), logvar)
        return loss

    def _keep(self, t: torch.Tensor, norm: torch.Tensor, logvar) -> None:
        """Add the draws' ||g|| and u(t) per t-bin to the statistics."""
        with torch.no_grad():
            stats = self.stats
            stats[G_SUM] += norm.sum().to(stats.dtype)
            stats[G_COUNT] += norm.numel()
            bins = (t / (math.pi / 2) * T_BINS).long().clamp_(0, T_BINS - 1)
            stats[U_SUMS:U_COUNTS].index_add_(0, bins, logvar(t).flatten().to(stats.dtype))
            stats[U_COUNTS:].index_add_(0, bins, torch.ones_like(t, dtype=stats.dtype))

    def note_gradients(self, net: torch.nn.Module) -> None:
        """Add the norm of net's gradients (all parameters together), before Adam's step, to the statistics."""
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        if grads:
            with torch.no_grad():  # one norm per tensor in foreach kernels, then theirs: no copy of the gradients
                self.stats[GRAD_SUM] += torch.nn.utils.get_total_norm(grads).to(self.stats.dtype)
                self.stats[GRAD_COUNT] += 1

    def take_stats(self) -> torch.Tensor:
        """The statistics since the last call (summable over ranks), and zero them."""
        stats = self.stats.clone()
        self.stats.zero_()
        return stats


def stats_row(totals: list[float]) -> dict:
    """A stats row's consistency entries from take_stats()'s totals (summed over ranks): g_norm (mean ||g|| before
    normalization), grad_norm (mean over steps) and logvar_t (mean u(t) per t-bin, keyed by the bin's centre; bins
    without draws left out)."""
    width = math.pi / 2 / T_BINS
    u = {f"{(i + 0.5) * width:.3f}": totals[U_SUMS + i] / totals[U_COUNTS + i]
         for i in range(T_BINS) if totals[U_COUNTS + i]}
    return dict(g_norm=totals[G_SUM] / max(totals[G_COUNT], 1), grad_norm=totals[GRAD_SUM] / max(totals[GRAD_COUNT], 1),
                logvar_t=u)
