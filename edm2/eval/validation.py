"""The validation loss of a denoiser with fixed draws (paper Eq. 13-16), and the halves of Eq. 21 per noise level.

The validation loss is Eq. 14: the denoising error of Eq. 13 weighted by lambda(sigma) (Eq. 15 for EDM2's
weighting), in expectation over the training distribution of noise levels (Eq. 16, ln(sigma) ~ N(P_mean, P_std^2),
for EDM2's). By default both are the network's own training loss (an edm2.loss.EDM2Loss, rebuilt from a
snapshot's record by edm2.loss.recorded_loss), never defaults. With the uncertainty off, Eq. 14 is the expected
training loss itself; with it learned (Eq. 21), u(sigma) is left out, as Eq. 14 leaves it out. It is reported per
element (Eq. 13's squared norm divided by the number of elements), so with EDM2's weighting a denoiser that
returns c_skip(sigma) x, as an initialized EDM2 network does, scores exactly 1 on data of variance sigma_data^2.

The expectation is estimated on fixed samples. Sample i is the dataset image at sample_indices(...)[i]; its
own generator, seeded with seed + i, draws sigma (for log-normal: one normal number), then the unit noise n, then,
for a latent dataset, the encoder's draw of the latent itself. So the estimate depends neither on the batch size
nor on the number of processes, and every network of a sweep is measured on the same draws.

Runs trained with another weighting or noise distribution measure different things by their own losses; a fixed,
named validation loss of VALIDATION_LOSSES (measured_loss) is the same formula for all of them, so their numbers
compare. OWN, the run's own loss, is the default; every row records the one it measured (ValidationSamples.record).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from edm2.data.dataset import ImageFolderDataset
from edm2.encoders import Encoder
from edm2.errors import EDM2Error
from edm2.layers import weights_normalized_once
from edm2.loss import DEFAULT_NOISE, DEFAULT_WEIGHTING, EDM2Loss
from edm2.runtime import distributed


class ValidationError(EDM2Error):
    """Validation data that does not fit the network: another shape, or labels it does not know."""


@dataclass(frozen=True)
class FixedLoss:
    """A validation loss that is the same for every run: a weighting and a noise distribution of edm2.loss, the
    distribution placed by P_mean and P_std, and a few words."""

    weighting: str
    noise: str
    P_mean: float
    P_std: float
    about: str


OWN = "own"  # the run's own loss, as its snapshots record it
VALIDATION_LOSSES: dict[str, FixedLoss | None] = {
    OWN: None,
    "edm2": FixedLoss(DEFAULT_WEIGHTING, DEFAULT_NOISE, -0.4, 1.0,
                      "Eq. 15's lambda, ln(sigma) ~ N(-0.4, 1.0^2) (Eq. 16; the ImageNet-512 presets')"),
    "edm2-64": FixedLoss(DEFAULT_WEIGHTING, DEFAULT_NOISE, -0.8, 1.6,
                         "Eq. 15's lambda, ln(sigma) ~ N(-0.8, 1.6^2) (Eq. 16; the ImageNet-64 and toy presets')"),
}


def fixed_losses_text() -> str:
    """The fixed validation losses with their few words, for a command line's help."""
    return "; ".join(f"{name}: {fixed.about}" for name, fixed in VALIDATION_LOSSES.items() if fixed is not None)


def measured_loss(name: str, own: EDM2Loss) -> EDM2Loss:
    """The loss a validation named name measures: own (the run's) for OWN, else the fixed loss of VALIDATION_LOSSES
    for own's sigma_data, with own's uncertainty (which says only whether the network's u(sigma) was learned).
    ValidationError for a name that is not in the table."""
    if name not in VALIDATION_LOSSES:
        raise ValidationError(f"validation loss {name!r} is not registered (known: {', '.join(VALIDATION_LOSSES)})")
    fixed = VALIDATION_LOSSES[name]
    if fixed is None:
        return own
    return EDM2Loss(fixed.P_mean, fixed.P_std, own.sigma_data, fixed.weighting, fixed.noise, own.uncertainty)


def loss_record(name: str, loss: EDM2Loss) -> dict:
    """What a measurement records of its validation loss: the name and the formula's parts (weighting, noise
    distribution, P_mean, P_std), so that two rows compare only when these agree."""
    return dict(name=name, weighting=loss.weighting, noise=loss.noise, P_mean=loss.P_mean, P_std=loss.P_std)


def sample_indices(num: int, dataset_size: int) -> list[int]:
    """Dataset indices of num samples, evenly spaced through the dataset (so a class-sorted dataset gives all
    classes); an image repeats, with other draws, when num exceeds the dataset."""
    return [i * dataset_size // num for i in range(num)]


class ValidationSamples:
    """Fixed samples (y, sigma, n, labels) of a dataset for a network: num of them, seeds seed .. seed+num-1, sigma
    from the loss measured (the network's training loss, or the fixed one of that name: measured_loss), whose
    weighting validation_loss applies."""

    def __init__(self, dataset: ImageFolderDataset, encoder: Encoder, net: torch.nn.Module, num: int,
                 loss: EDM2Loss, seed: int = 0, name: str = OWN):
        self.dataset, self.encoder, self.num, self.seed, self.name = dataset, encoder, num, seed, name
        self.loss = measured_loss(name, loss)
        self.label_dim = net.label_dim
        self.indices = sample_indices(num, len(dataset))
        check_fits(dataset, encoder, net.img_channels, net.img_resolution, net.label_dim)

    def record(self) -> dict:
        """The validation loss these samples measure, as a row records it (loss_record)."""
        return loss_record(self.name, self.loss)

    def batch(self, samples: Sequence[int], device: torch.device | str = "cpu") -> tuple:
        """(y, sigma, n, labels or None) of the given sample numbers, on device."""
        ys, sigmas, noises = [], [], []
        for i in samples:
            image, _ = self.dataset[self.indices[i]]
            generator = torch.Generator().manual_seed(self.seed + i)
            sigmas.append(self.loss.draw_sigma([], generator=generator))
            channels = self.encoder.out_channels(image.shape[0])
            noises.append(torch.randn([channels, *image.shape[1:]], generator=generator))
            with torch.random.fork_rng(devices=[]):
                torch.random.set_rng_state(generator.get_state())  # a latent's draw continues the sample's stream
                ys.append(self.encoder.encode_latents(torch.from_numpy(image)[None])[0])
        labels = None
        if self.label_dim:
            classes = torch.as_tensor([int(self.dataset.raw_labels[self.indices[i]]) for i in samples])
            labels = torch.nn.functional.one_hot(classes, self.label_dim).to(device, torch.float32)
        sigma = torch.stack(sigmas).reshape(-1, 1, 1, 1).to(device)
        return torch.stack(ys).to(device), sigma, torch.stack(noises).to(device), labels


def check_fits(dataset: ImageFolderDataset, encoder: Encoder, img_channels: int, img_resolution: int,
               label_dim: int) -> None:
    """Raise ValidationError unless the dataset's images, encoded, are a network's input and its labels fit it."""
    shape = (encoder.out_channels(dataset.num_channels), dataset.resolution)
    if shape != (img_channels, img_resolution):
        raise ValidationError(f"{dataset.path} holds {dataset.num_channels}-channel {dataset.resolution}x"
                              f"{dataset.resolution} images, which encode to {shape[0]} channels, but the network "
                              f"takes {img_channels} channels at {img_resolution}x{img_resolution}")
    if label_dim and not dataset.has_labels:
        raise ValidationError(f"{dataset.path} has no labels, but the network is conditioned on {label_dim} classes")
    if label_dim and dataset.label_dim > label_dim:
        raise ValidationError(f"{dataset.path} has labels up to {dataset.label_dim - 1}, but the network knows "
                              f"{label_dim} classes")


def validation_loss(net: torch.nn.Module, samples: ValidationSamples, batch_size: int = 64,
                    device: torch.device | str = "cpu") -> float:
    """Eq. 14 per element, the mean over the samples of lambda(sigma) |D(y + sigma n; sigma) - y|^2 / elements,
    lambda the weighting of the samples' loss, with this rank's share of the samples, summed over ranks in float64."""
    weight = samples.loss.weight
    total = torch.zeros([], dtype=torch.float64, device=device)
    batches = distributed.rank_batches(range(samples.num), batch_size, distributed.get_rank(),
                                       distributed.get_world_size(), skip_empty=True)
    with weights_normalized_once(net):
        for batch in batches:
            y, sigma, noise, labels = samples.batch(batch, device)
            denoised = net(y + sigma * noise, sigma, labels)
            error = (denoised.to(torch.float64) - y.to(torch.float64)).square().flatten(1).mean(1)
            total += (weight(sigma.to(torch.float64)).flatten() * error).sum()
    return float(distributed.all_reduce_sum(total)) / samples.num


def sigma_grid(P_mean: float, P_std: float, num: int = 11, spread: float = 2.5) -> list[float]:
    """num noise levels, evenly spaced in ln(sigma) over P_mean +- spread * P_std (the bulk of Eq. 16)."""
    return np.exp(np.linspace(P_mean - spread * P_std, P_mean + spread * P_std, num)).tolist()


def loss_per_sigma(net: torch.nn.Module, y: torch.Tensor, noise: torch.Tensor, labels: torch.Tensor | None,
                   sigmas: Sequence[float], loss: EDM2Loss) -> tuple[list[float], list[float] | None]:
    """At each sigma, lambda(sigma) L(D; sigma) (Eq. 13 per element, on the batch y with unit noise n; lambda the
    weighting of the network's training loss) and u(sigma); None for u when the loss does not learn it (the
    network's u head was never trained, so its values mean nothing).

    At the optimum of Eq. 21 over u, e^u(sigma) equals lambda(sigma) L(D; sigma): the first list is what the
    uncertainty u(sigma) learns to predict. With the uncertainty off, it is the training loss at sigma.
    """
    weight = loss.weight
    errors, logvars = [], []
    with weights_normalized_once(net):
        for sigma in sigmas:
            denoised, logvar = net(y + sigma * noise, sigma, labels, return_logvar=True)
            error = (denoised.to(torch.float64) - y.to(torch.float64)).square().mean()
            errors.append(float(weight(torch.tensor(sigma, dtype=torch.float64)) * error))
            logvars.append(float(logvar.flatten()[0]))
    return errors, logvars if loss.learns_u else None
