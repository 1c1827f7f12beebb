"""The EDM2 training loss: uncertainty-weighted denoising error (paper Eq. 21), with the loss weighting lambda(sigma)
(Eq. 15), the training noise distribution (Eq. 16) and the uncertainty u(sigma) (learned, Eq. 21, or off, Eq. 14's
weighted error) as named choices: one table of each. A new weighting is one function and one row of WEIGHTINGS; a
snapshot records its loss (record()), and whatever evaluates a loss rebuilds it from that record (recorded_loss),
never from defaults.

The learned uncertainty absorbs the weighting: for a fixed denoiser, Eq. 21 is least at e^u(sigma) = lambda(sigma)
L(sigma), and there the denoiser's gradient is grad L / L(sigma) whatever lambda is. A weighting changes what is
trained only with the uncertainty off."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from edm2.errors import EDM2Error


class LossError(EDM2Error):
    """A loss weighting, noise distribution or uncertainty that is not in its table; the message names it and the
    table."""


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


@dataclass(frozen=True)
class Uncertainty:
    """An uncertainty's record: objective(lambda, error, u) is the per-element training loss from the weight
    lambda(sigma), the squared error |D - y|^2 and the network's log-variance u(sigma); learned says whether u is
    trained, and so whether a network's u(sigma) means anything; and a few words."""

    objective: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    learned: bool
    about: str


def learned_uncertainty(weight: torch.Tensor, error: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """lambda(sigma) / e^u(sigma) * error + u(sigma) (Eq. 21): the error weighted by lambda / e^u, plus u."""
    return weight / logvar.exp() * error + logvar


def no_uncertainty(weight: torch.Tensor, error: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """lambda(sigma) * error (Eq. 14's weighted denoising error), without u."""
    # 0 * u keeps u's head in the graph with a zero gradient: DistributedDataParallel expects a gradient for every
    # parameter, and Adam leaves a parameter whose gradients are all zero where it is.
    return weight * error + 0 * logvar


WEIGHTINGS: dict[str, Weighting] = {
    "edm2": Weighting(edm2_weight, about="1 / c_out^2, Eq. 15"),
}
NOISE_DISTRIBUTIONS: dict[str, NoiseDistribution] = {
    "log-normal": NoiseDistribution(log_normal_sigma, about="ln(sigma) ~ N(P_mean, P_std^2), Eq. 16"),
}
UNCERTAINTIES: dict[str, Uncertainty] = {
    "learned": Uncertainty(learned_uncertainty, learned=True, about="lambda / e^u L + u, u(sigma) learned, Eq. 21"),
    "off": Uncertainty(no_uncertainty, learned=False, about="lambda L, Eq. 14's weighted error, no u"),
}
# The EDM2 recipe, and the loss of a snapshot written before the loss was recorded by name.
DEFAULT_WEIGHTING, DEFAULT_NOISE, DEFAULT_UNCERTAINTY = "edm2", "log-normal", "learned"


def check_loss_names(weighting: str, noise: str, uncertainty: str = DEFAULT_UNCERTAINTY) -> None:
    """Raise LossError unless the three names are in their tables."""
    for kind, name, table in (("loss weighting", weighting, WEIGHTINGS),
                              ("noise distribution", noise, NOISE_DISTRIBUTIONS),
                              ("uncertainty", uncertainty, UNCERTAINTIES)):
        if name not in table:
            raise LossError(f"{kind} {name!r} is not registered (known: {', '.join(table)})")


class EDM2Loss:
    """Per-element loss lambda(sigma)/e^u(sigma) * |D(y+n; sigma) - y|^2 + u(sigma) (Eq. 21), or lambda(sigma) *
    |D(y+n; sigma) - y|^2 with the uncertainty off, with the weighting, the noise distribution and the uncertainty
    named in WEIGHTINGS, NOISE_DISTRIBUTIONS and UNCERTAINTIES (EDM2's by default)."""

    def __init__(self, P_mean: float = -0.4, P_std: float = 1.0, sigma_data: float = 0.5,
                 weighting: str = DEFAULT_WEIGHTING, noise: str = DEFAULT_NOISE,
                 uncertainty: str = DEFAULT_UNCERTAINTY):
        check_loss_names(weighting, noise, uncertainty)
        self.P_mean = P_mean
        self.P_std = P_std
        self.sigma_data = sigma_data
        self.weighting, self.noise, self.uncertainty = weighting, noise, uncertainty

    def record(self) -> dict:
        """The loss as a snapshot's metadata records it: the names and the noise distribution's parameters."""
        return dict(weighting=self.weighting, noise=self.noise, uncertainty=self.uncertainty, P_mean=self.P_mean,
                    P_std=self.P_std)

    @property
    def learns_u(self) -> bool:
        """Whether this loss trains the network's uncertainty u(sigma) (Eq. 21)."""
        return UNCERTAINTIES[self.uncertainty].learned

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
        # The single-sample estimate of Eq. 13, weighted by lambda(sigma) / e^u plus u (Eq. 21) or by lambda (off).
        return UNCERTAINTIES[self.uncertainty].objective(self.weight(sigma), (denoised - images).square(), logvar)


def recorded_loss(record: object, sigma_data: object) -> EDM2Loss:
    """The loss a snapshot's metadata 'loss' record names, for a network of sigma_data; a record without names (a
    snapshot written before they were recorded) means EDM2's weighting, noise distribution and learned uncertainty.
    LossError for a record without its noise distribution's P_mean and P_std, or one naming what is not
    registered."""
    record = record if isinstance(record, dict) else {}
    if not all(type(record.get(k)) in (int, float) for k in ("P_mean", "P_std")):
        raise LossError("no training noise distribution (loss P_mean, P_std)")
    if type(sigma_data) not in (int, float):
        raise LossError(f"no network sigma_data (found {sigma_data!r})")
    names = [record.get(k, default) for k, default in (("weighting", DEFAULT_WEIGHTING), ("noise", DEFAULT_NOISE),
                                                        ("uncertainty", DEFAULT_UNCERTAINTY))]
    if not all(isinstance(name, str) for name in names):
        raise LossError(f"the metadata's loss names {', '.join(map(repr, names))} are not all names")
    return EDM2Loss(record["P_mean"], record["P_std"], sigma_data, *names)
