"""EDM sampler (Heun with churn and guidance) and per-seed random inputs, so an image depends on its seed alone."""

from __future__ import annotations

import math
from typing import Callable, Iterator, Sequence

import torch
import tqdm

from edm2 import distributed


def sigma_steps(num_steps: int, sigma_min: float, sigma_max: float, rho: float) -> torch.Tensor:
    """Noise levels t_0 > ... > t_{N-1} of EDM Eq. 5 followed by t_N = 0, in float64."""
    i = torch.arange(num_steps, dtype=torch.float64)
    t = (sigma_max ** (1 / rho) + i / max(num_steps - 1, 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    return torch.cat([t, torch.zeros(1, dtype=torch.float64)])


def edm_sampler(
    net: Callable,
    noise: torch.Tensor,
    labels: torch.Tensor | None = None,
    gnet: Callable | None = None,
    num_steps: int = 32,
    sigma_min: float = 0.002,
    sigma_max: float = 80,
    rho: float = 7,
    guidance: float = 1,
    S_churn: float = 0,
    S_min: float = 0,
    S_max: float = float("inf"),
    S_noise: float = 1,
    randn_like: Callable[[torch.Tensor], torch.Tensor] = torch.randn_like,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Solve the probability-flow ODE from sigma_max to 0 (EDM Algorithm 1/2 with sigma(t) = t)."""

    def denoise(x: torch.Tensor, t: float) -> torch.Tensor:
        sigma = torch.full([x.shape[0]], t, dtype=dtype, device=x.device)
        d = net(x, sigma, labels).to(dtype)
        if guidance == 1:
            return d
        # Paper Eq. 152: w * D_net + (1 - w) * D_gnet.
        return torch.lerp(gnet(x, sigma, labels).to(dtype), d, guidance)

    if guidance != 1 and gnet is None:
        raise ValueError("guidance other than 1 needs a guiding network (gnet)")
    t_steps = sigma_steps(num_steps, sigma_min, sigma_max, rho).tolist()
    gamma_max = min(S_churn / num_steps, math.sqrt(2) - 1)
    x_next = noise.to(dtype) * t_steps[0]
    for i, (t_cur, t_next) in enumerate(zip(t_steps[:-1], t_steps[1:])):
        x_cur = x_next
        # Churn (EDM Algorithm 2): raise the noise level to t_hat by adding fresh noise.
        gamma = gamma_max if S_min <= t_cur <= S_max else 0
        t_hat = t_cur + gamma * t_cur
        x_hat = x_cur
        if gamma > 0:
            x_hat = x_cur + math.sqrt(t_hat**2 - t_cur**2) * S_noise * randn_like(x_cur)
        # Euler step along dx/dsigma = (x - D(x; sigma)) / sigma (paper Eq. 153) ...
        d_cur = (x_hat - denoise(x_hat, t_hat)) / t_hat
        x_next = x_hat + (t_next - t_hat) * d_cur
        # ... corrected by Heun's 2nd-order rule except on the last step, which ends at sigma = 0.
        if i < num_steps - 1:
            d_prime = (x_next - denoise(x_next, t_next)) / t_next
            x_next = x_hat + (t_next - t_hat) * (0.5 * d_cur + 0.5 * d_prime)
    return x_next


def check_guidance_pair(net: torch.nn.Module, gnet: torch.nn.Module) -> None:
    """Raise ValueError unless gnet can guide net: Eq. 152 blends their outputs pixel by pixel."""
    shape, gshape = (net.img_resolution, net.img_channels), (gnet.img_resolution, gnet.img_channels)
    if shape != gshape:
        raise ValueError(
            f"the guiding network has resolution {gshape[0]} with {gshape[1]} channels "
            f"but the main network has resolution {shape[0]} with {shape[1]}"
        )
    if gnet.label_dim not in (0, net.label_dim):
        raise ValueError(f"the guiding network has {gnet.label_dim} classes but the main network has {net.label_dim}")


class SeededRandom:
    """One torch.Generator per image, seeded by that image's seed; draws stack along the batch axis."""

    def __init__(self, seeds: Sequence[int], device: torch.device | str = "cpu"):
        self.generators = [torch.Generator(device).manual_seed(int(seed)) for seed in seeds]
        self.device = torch.device(device)

    def randn(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Normal noise of shape [len(seeds), *shape]; row i comes from seed i's generator."""
        return torch.stack([torch.randn(tuple(shape), generator=g, device=self.device, dtype=dtype) for g in self.generators])

    def randint(self, high: int) -> torch.Tensor:
        """One integer in [0, high) per image, from that image's generator."""
        return torch.cat([torch.randint(high, (1,), generator=g, device=self.device) for g in self.generators])

    def randn_like(self, x: torch.Tensor) -> torch.Tensor:
        """Drop-in for torch.randn_like that keeps each image on its own generator."""
        return self.randn(x.shape[1:], dtype=x.dtype)


def seeded_inputs(
    seeds: Sequence[int],
    img_channels: int,
    img_resolution: int,
    label_dim: int,
    class_idx: int | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor | None, Callable[[torch.Tensor], torch.Tensor]]:
    """Initial unit noise, one-hot class labels (random per seed unless class_idx) and a per-seed randn_like."""
    rnd = SeededRandom(seeds, device)
    noise = rnd.randn([img_channels, img_resolution, img_resolution])
    labels = None
    if label_dim > 0:
        # Draw the random class even when class_idx overrides it, so churn noise does not depend on class_idx.
        classes = rnd.randint(label_dim)
        if class_idx is not None:
            classes = torch.full_like(classes, class_idx)
        labels = torch.nn.functional.one_hot(classes, label_dim).to(torch.float32)
    return noise, labels, rnd.randn_like


def generate_images(
    net: torch.nn.Module,
    encoder,
    seeds: Sequence[int],
    class_idx: int | None = None,
    gnet: torch.nn.Module | None = None,
    guidance: float = 1.0,
    batch_size: int = 32,
    device: torch.device | str | None = None,
    **sampler_kwargs,
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Sample this rank's share of `seeds`; yield (batch seeds, uint8 NCHW images decoded by `encoder`)."""
    device = torch.device(device) if device is not None else distributed.device()
    if class_idx is not None and not 0 <= class_idx < net.label_dim:
        raise ValueError(f"class {class_idx} is out of range for a network with {net.label_dim} classes")
    batches = distributed.rank_batches(seeds, batch_size, distributed.get_rank(), distributed.get_world_size())
    batches = [b for b in batches if b]
    for batch_seeds in tqdm.tqdm(batches, unit="batch", disable=not distributed.is_main()):
        noise, labels, randn_like = seeded_inputs(
            batch_seeds, net.img_channels, net.img_resolution, net.label_dim, class_idx, device
        )
        with torch.no_grad():
            latents = edm_sampler(net, noise, labels, gnet=gnet, guidance=guidance, randn_like=randn_like, **sampler_kwargs)
            images = encoder.decode(latents)
        yield batch_seeds, images
