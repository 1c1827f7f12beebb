"""Scoring a toy snapshot by the exact density: samples of a diffusion model (Heun, edm2.sampler) or of a
consistency model (its own 1-, 2- or N-step sampler), and their mean log-likelihood under the true mixture.

Both start from the same Gaussian at sigma_max (80, EDM's): a diffusion model from sigma_max z and Heun's S steps
(2 S - 1 network evaluations, the last step being Euler's), a consistency model from sigma_d z at t_max =
arctan(sigma_max / sigma_d) and S steps (S evaluations). Noise comes from one generator of a fixed seed.
"""

from __future__ import annotations

import torch

from edm2.toy.consistency import SIGMA_MAX, ToyFlow, consistency_sample
from edm2.toy.gmm import GaussianMixture, ToyError
from edm2.toy.model import ToyDenoiser, sample_trajectories

NUM_SAMPLES = 4096


def toy_samples(net: ToyDenoiser | ToyFlow, num_steps: int, num_samples: int = NUM_SAMPLES, seed: int = 0,
                sigma_max: float = SIGMA_MAX) -> torch.Tensor:
    """num_samples points [n, 2] of net in num_steps steps: Heun's for a denoiser, consistency steps for a
    ToyFlow; the same seed gives the same points."""
    if type(num_steps) is not int or num_steps < 1:
        raise ToyError(f"sampling takes 1 or more steps, not {num_steps!r}")
    device = next(net.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    if isinstance(net, ToyFlow):
        return consistency_sample(net, torch.randn([num_steps, num_samples, 2], generator=generator, device=device),
                                  sigma_max)
    noise = torch.randn([num_samples, 2], generator=generator, device=device)
    return sample_trajectories(net, noise * sigma_max, sigma_max, num_steps=num_steps)[-1]


def mean_loglik(truth: GaussianMixture, points: torch.Tensor) -> float:
    """The mean exact log-likelihood of points [n, 2] under the truth (at sigma 0), summed in float64."""
    return truth.logp(points).double().mean().item()


def snapshot_classes(metadata: dict) -> str:
    """The classes a toy snapshot learned ('A' for the release's pickles, which are class A's), from its metadata."""
    training = metadata.get("training", {})
    classes = training.get("classes", "A") if isinstance(training, dict) else None
    if classes not in ("A", "B", "AB"):
        raise ToyError(f"the snapshot's metadata names classes {classes!r}; expected 'A', 'B' or 'AB'")
    return classes
