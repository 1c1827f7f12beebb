"""The EDM2 training loss: uncertainty-weighted denoising error (paper Eq. 21), with the loss weighting lambda(sigma)
(Eq. 15) and the training noise distribution (Eq. 16) as named choices: one table of each. A new weighting is one
function and one row of WEIGHTINGS; a snapshot records its loss (record()), and whatever evaluates a loss rebuilds
it from that record (recorded_loss), never from defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from edm2.errors import EDM2Error


class LossError(EDM2Error):
    """A loss weighting or noise distribution that is not in its table; the message names it and the table."""


def edm2_weight(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2 = 1 / c_out(sigma)^2 (Eq. 15)."""
    return (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2


def log_normal_sigma(shape: Sequence[int], P_mean: float, P_std: float, device: torch.device | str = "cpu",
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Noise levels of the training distribution, ln(sigma) ~ N(P_mean, P_std^2) (Eq. 16), drawn from generator
    (default: torch's global one)."""
    return (torch.randn(shape, device=device, generator=generator) * P_std + P_mean).exp()


@dataclass(frozen=True)
class Weighting:
    """A loss weighting's record: lambda(sigma; sigma_data) of the denoising error (Eq. 14), and a few words."""

    weight: Callable[[torch.Tensor, float], torch.Tensor]
    about: str


@dataclass(frozen=True)
class NoiseDistribution:
    """A training noise distribution's record: sample(shape, P_mean, P_std, device, generator) draws noise levels,
    P_mean and P_std placing them on the scale of ln(sigma); and a few words."""

    sample: Callable[..., torch.Tensor]
    about: str


WEIGHTINGS: dict[str, Weighting] = {
    "edm2": Weighting(edm2_weight, about="1 / c_out^2, Eq. 15"),
}
NOISE_DISTRIBUTIONS: dict[str, NoiseDistribution] = {
    "log-normal": NoiseDistribution(log_normal_sigma, about="ln(sigma) ~ N(P_mean, P_std^2), Eq. 16"),
}
# The EDM2 recipe, and the loss of a snapshot written before the loss was recorded by name.
DEFAULT_WEIGHTING, DEFAULT_NOISE = "edm2", "log-normal"


def check_loss_names(weighting: str, noise: str) -> None:
    """Raise LossError unless both names are in their tables."""
    for kind, name, table in (("loss weighting", weighting, WEIGHTINGS), ("noise distribution", noise,
                                                                         NOISE_DISTRIBUTIONS)):
        if name not in table:
            raise LossError(f"{kind} {name!r} is not registered (known: {', '.join(table)})")


class EDM2Loss:
    """Per-element loss lambda(sigma)/e^u(sigma) * |D(y+n; sigma) - y|^2 + u(sigma) (Eq. 21), with the weighting and
    the noise distribution named in WEIGHTINGS and NOISE_DISTRIBUTIONS (EDM2's by default)."""

    def __init__(self, P_mean: float = -0.4, P_std: float = 1.0, sigma_data: float = 0.5,
                 weighting: str = DEFAULT_WEIGHTING, noise: str = DEFAULT_NOISE):
        check_loss_names(weighting, noise)
        self.P_mean = P_mean
        self.P_std = P_std
        self.sigma_data = sigma_data
        self.weighting, self.noise = weighting, noise

    def record(self) -> dict:
        """The loss as a snapshot's metadata records it: the names and the noise distribution's parameters."""
        return dict(weighting=self.weighting, noise=self.noise, P_mean=self.P_mean, P_std=self.P_std)

    def draw_sigma(self, shape: Sequence[int], device: torch.device | str = "cpu",
                   generator: torch.Generator | None = None) -> torch.Tensor:
        """Noise levels of the training distribution (Eq. 16 for log-normal) drawn from generator (default: torch's
        global one)."""
        return NOISE_DISTRIBUTIONS[self.noise].sample(shape, self.P_mean, self.P_std, device, generator)

    def sample_sigma(self, batch_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Noise levels of the training distribution, shape [N,1,1,1]."""
        return self.draw_sigma([batch_size, 1, 1, 1], device)

    def weight(self, sigma: torch.Tensor) -> torch.Tensor:
        """lambda(sigma) of the weighting (Eq. 15 for edm2)."""
        return WEIGHTINGS[self.weighting].weight(sigma, self.sigma_data)

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


def recorded_loss(record: object, sigma_data: object) -> EDM2Loss:
    """The loss a snapshot's metadata 'loss' record names, for a network of sigma_data; a record without names (a
    snapshot written before they were recorded) means EDM2's weighting and noise distribution. LossError for a
    record without its noise distribution's P_mean and P_std, or one naming what is not registered."""
    record = record if isinstance(record, dict) else {}
    if not all(type(record.get(k)) in (int, float) for k in ("P_mean", "P_std")):
        raise LossError("no training noise distribution (loss P_mean, P_std)")
    if type(sigma_data) not in (int, float):
        raise LossError(f"no network sigma_data (found {sigma_data!r})")
    names = [record.get(k, default) for k, default in (("weighting", DEFAULT_WEIGHTING), ("noise", DEFAULT_NOISE))]
    if not all(isinstance(name, str) for name in names):
        raise LossError(f"the metadata's loss names {names[0]!r} and {names[1]!r} are not both names")
    return EDM2Loss(record["P_mean"], record["P_std"], sigma_data, *names)
