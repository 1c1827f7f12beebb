"""Consistency distillation (sCD) and training (sCT) of the toy example's consistency model on a toy teacher (Lu and
Song 2025, Algorithm 1, through edm2.consistency.algorithm1_loss: the loss the image networks use).

The student (edm2.toy.consistency.ToyFlow) is not the teacher's network (an energy model has no direct output), so
it starts from the teacher another way: init_iterations of fitting F to the teacher's velocity sigma_d F_teacher
(edm2.consistency.denoiser_velocity), a short diffusion training of the student on the teacher. Then Algorithm 1
with sCD's tangent from the teacher's ODE or sCT's from ground-truth samples (edm2.toy.gmm), tangent warmup, Adam
with betas (0.9, 0.99) and a power-function EMA of the student (paper Eq. 127, time in iterations, as
training.toy's), whose snapshots are the trained models.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from edm2.consistency import (algorithm1_loss, denoiser_velocity, noised, sample_t, sct_tangent, tangent_warmup,
                              TANGENT_CONSTANT)
from edm2.layers import force_weight_normalization
from edm2.phema import PowerFunctionEMA
from edm2.toy.consistency import ToyFlow
from edm2.toy.gmm import GaussianMixture
from edm2.toy.model import ToyDenoiser, denoiser
from training.state import adam

METHODS = ("scd", "sct")


@dataclasses.dataclass(frozen=True)
class ToyDistillation:
    """One toy consistency run on a teacher."""

    method: str = "scd"
    classes: str = "A"
    num_layers: int = 4
    # Four times the teacher's width: an MLP that outputs F needs it where the teacher's energy model does not (fit
    # to the exact velocity for 2,048 iterations, then Heun's 32 steps: -2.54 nats at width 64, -0.19 at 256).
    hidden_dim: int = 256
    iterations: int = 2048
    init_iterations: int = 1024
    batch_size: int = 4096
    seed: int = 0
    # The toy's data: class A's points have a standard deviation near 0.5 (= sigma_d) while its detail (the thin
    # branch tips) lives at sigma ~ 0.01-0.1, so the teacher's own P_mean -2.3, P_std 1.5 is the default here (the
    # paper's -0.8, 1.6 learns faster at first and is overtaken by 2,048 iterations: docs/few-step.md).
    P_mean: float = -2.3
    P_std: float = 1.5
    lr: float = 1e-3
    init_lr: float = 1e-2
    warmup_iterations: int = 512
    ema_std: float = 0.050
    c: float = TANGENT_CONSTANT
    prior: bool = True
    snapshot_iter: int = 256

    def snapshot_due(self, iteration: int) -> bool:
        """Whether the EMA is saved after this many iterations: every snapshot_iter, and at the end."""
        return iteration % self.snapshot_iter == 0 or iteration == self.iterations

    def consistency_metadata(self, teacher: str | None, sigma_data: float) -> dict:
        """The snapshot's 'consistency' record (the convention every sCM helper shares)."""
        return {"method": self.method, "sigma_data": sigma_data, "teacher": teacher, "P_mean": self.P_mean,
                "P_std": self.P_std, "tangent_warmup_nimg": self.warmup_iterations * self.batch_size, "c": self.c,
                "prior": self.prior}


def fit_to_teacher(student: ToyFlow, teacher: ToyDenoiser, data: GaussianMixture, opts: ToyDistillation,
                   generator: torch.Generator) -> None:
    """opts.init_iterations of Adam fitting F(x_t / sigma_d, t) to the teacher's velocity / sigma_d at x_t =
    noised(x0, z, t), x0 from data and t from the proposal distribution: the student learns the teacher's ODE
    before Algorithm 1."""
    device = student.gain.device
    sigma_data = student.sigma_data
    target, teach = data, denoiser(teacher)
    optimizer = adam(student.parameters(), device)
    optimizer.param_groups[0]["lr"] = opts.init_lr
    for _ in range(opts.init_iterations):
        t = sample_t([opts.batch_size], opts.P_mean, opts.P_std, sigma_data, device, generator)
        x_t = noised(target.sample(opts.batch_size, generator=generator),
                     sigma_data * torch.randn([opts.batch_size, 2], generator=generator, device=device), t)
        velocity = denoiser_velocity(lambda x, sigma: teach(x, sigma, None), x_t, t, sigma_data).detach()
        force_weight_normalization(student)
        loss = (student(x_t / sigma_data, t) - velocity / sigma_data).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def train_toy_consistency(opts: ToyDistillation, teacher: ToyDenoiser, data: GaussianMixture, device: torch.device,
                          on_snapshot: Callable[[int, ToyFlow], None]) -> ToyFlow:
    """Initialize a student from the teacher, then train it as opts says on points of data (the ground truth of
    opts.classes, on device), calling on_snapshot(iterations done, EMA student) when a snapshot is due; returns the
    EMA."""
    torch.manual_seed(opts.seed)
    generator = torch.Generator(device).manual_seed(opts.seed)
    sigma_data = teacher.sigma_data
    student = ToyFlow(num_layers=opts.num_layers, hidden_dim=opts.hidden_dim, sigma_data=sigma_data)
    student = student.to(device).train().requires_grad_(True)
    teacher = teacher.to(device).eval().requires_grad_(False)
    fit_to_teacher(student, teacher, data, opts, generator)
    target, teach = data, denoiser(teacher)

    def teacher_tangent(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return denoiser_velocity(lambda x, sigma: teach(x, sigma, None), x_t, t, sigma_data)

    ema = PowerFunctionEMA(student, stds=(opts.ema_std,))
    optimizer = adam(student.parameters(), device)
    optimizer.param_groups[0]["lr"] = opts.lr
    for iteration in range(opts.iterations):
        t = sample_t([opts.batch_size], opts.P_mean, opts.P_std, sigma_data, device, generator)
        x0 = target.sample(opts.batch_size, generator=generator)
        z = sigma_data * torch.randn(x0.shape, generator=generator, device=device)
        tangent = (lambda x_t: teacher_tangent(x_t, t)) if opts.method == "scd" else sct_tangent(x0, z, t)
        r = tangent_warmup(iteration, opts.warmup_iterations)
        force_weight_normalization(student)
        loss, _ = algorithm1_loss(student, student.logvar, x0, z, t, tangent, r, sigma_data,
                                  seed=opts.seed * 1_000_003 + iteration, c=opts.c, prior=opts.prior)
        optimizer.zero_grad(set_to_none=True)
        loss.mean().backward()
        optimizer.step()
        ema.update(cur_nimg=iteration + 1, batch_size=1)
        if opts.snapshot_due(iteration + 1):
            on_snapshot(iteration + 1, ema.emas[0])
    return ema.emas[0]
