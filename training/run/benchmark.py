"""The loop's own training step on synthetic data shaped like a preset's dataset, a preset's network for such data,
and the timed window of training steps, for measuring speed and memory (the dry run, data_parallel_speed,
scripts/bench_train.py, scripts/bench_sampler.py, scripts/gpu_check.py)."""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import numpy as np
import torch

from edm2.encoders import Encoder, StabilityVAEEncoder, StandardRGBEncoder
from edm2.networks import Precond
from edm2.runtime import distributed
from training.options import TrainingOptions
from training.presets import PRESETS
from training.state import TrainingState
from training.step import TrainingStep, training_step


@dataclasses.dataclass(frozen=True)
class SyntheticData:
    """The shape of a preset's dataset: the release's presets read 64x64 (img512: 8-channel mean/std VAE latents;
    img64: RGB) with 1000 classes, the toy presets 16x16 RGB with 6."""

    resolution: int
    channels: int
    label_dim: int
    latents: bool

    @classmethod
    def of_preset(cls, preset: str, resolution: int | None = None) -> SyntheticData:
        """The data a preset trains on, at `resolution` if given."""
        release, latents = preset.startswith("edm2-"), preset.startswith("edm2-img512")
        return cls(resolution or (64 if release else 16), 8 if latents else 3, 1000 if release else 6, latents)

    def encoder(self) -> Encoder:
        """The encoder that turns such data into network input."""
        return StabilityVAEEncoder() if self.latents else StandardRGBEncoder()

    def batches(self, batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless (images, one-hot labels) batches as the data loader yields them: uint8 pixels or float latents."""
        rng = np.random.default_rng(0)
        shape = (batch, self.channels // 2 if self.latents else self.channels, self.resolution, self.resolution)
        if self.latents:  # mean/std latents as a dataset stores them
            images = torch.cat([torch.randn(shape) * 4, torch.rand(shape) * 0.1], dim=1)
        else:
            images = torch.from_numpy(rng.integers(0, 256, shape, dtype=np.uint8))
        labels = torch.eye(self.label_dim)[rng.integers(0, self.label_dim, batch)]
        while True:
            yield images, labels


def synthetic_step(preset: str, batch_gpu: int, device: torch.device, rounds: int = 1, resolution: int | None = None,
                   **options) -> TrainingStep:
    """One process's training step of `preset` at batch_gpu x rounds images on synthetic data; options are further
    TrainingOptions (precision, compile, channels_last, checkpoint_activations, cpu_16bit, ...)."""
    data = SyntheticData.of_preset(preset, resolution)
    encoder = data.encoder()
    opts = TrainingOptions.from_preset(
        preset, dataset=dict(resolution=data.resolution, num_channels=data.channels, label_dim=data.label_dim),
        encoder=encoder.config(), batch=batch_gpu * rounds, **options,
    )
    state = TrainingState.create(opts, encoder.out_channels(data.channels), device)
    state.cur_nimg = 10 * opts.batch  # past the start, where the learning rate is 0
    return TrainingStep.of_run(state, opts, encoder, data.batches(batch_gpu), device=device, rounds=rounds)


def group_images_per_s(step: TrainingStep, steps: int, images: int) -> float:
    """Images/s of `steps` training steps of `images` images each (all the processes' together), timed from a barrier
    to a barrier after the last loss is read (which waits for the device), so every rank's steps fall inside."""
    # Not torch.utils.benchmark.Timer: it times one process's callable, and this window opens and closes on barriers
    # that every rank of the group passes.
    distributed.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        loss = training_step(step)
    float(loss)
    distributed.barrier()
    return steps * images / (time.perf_counter() - started)


def preset_network(preset: str, label_dim: int | None = None) -> Precond:
    """A fresh network of a preset for its synthetic data (no dropout, 32-bit); label_dim overrides the data's."""
    data, recipe = SyntheticData.of_preset(preset), PRESETS[preset]
    label_dim = data.label_dim if label_dim is None else label_dim
    return Precond(data.resolution, data.encoder().out_channels(data.channels), label_dim,
                   model_channels=recipe.channels, **recipe.network)


def with_unit_gains(net: Precond) -> Precond:
    """net with every gain at 1, as in a trained network (a fresh one's zero gains make the U-Net output 0)."""
    with torch.no_grad():
        for name, param in net.named_parameters():
            if name.endswith("gain"):
                param.fill_(1)
    return net
