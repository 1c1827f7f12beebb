"""'mp-resnet': docs/extending.md's worked example of a network family (A network family).

The U-Net's own blocks (edm2.networks.Block, Figure 21) stacked at one resolution: no down- or upsampling and no
skip connections, a baseline for asking what the U-Net's levels buy. It takes --channels and --dropout, and its own
hyperparameter --depth (MPResNetHyperparameters); the magnitude probe and FLOP counts read its blocks 'block0',
'block1', ...
"""

from __future__ import annotations

import dataclasses
import math

import torch

from edm2 import network_args
from edm2.families import NetworkFamily, register
from edm2.layers import MPConv, MPFourier, mp_silu, mp_sum
from edm2.network_args import IntegerBound, hyperparameter
from edm2.networks import Block


@dataclasses.dataclass(frozen=True)
class MPResNetHyperparameters:
    """What a run chooses of mp-resnet (train_edm2.py --depth)."""

    depth: int = hyperparameter(4, IntegerBound(1, network_args.MAX_BLOCKS), "Blocks of mp-resnet, all at the data's "
                                "resolution")


class MPResNet(torch.nn.Module):
    """Embedding, a 3x3 convolution, depth magnitude-preserving blocks, a 3x3 convolution with a learned gain."""

    def __init__(self, img_resolution: int, img_channels: int, label_dim: int, model_channels: int = 64,
                 dropout: float = 0.0, depth: int = MPResNetHyperparameters.depth):
        # Arguments may come from a file: check them before building anything.
        network_args.integer("img_resolution", img_resolution, 1, network_args.MAX_RESOLUTION)
        network_args.integer("img_channels", img_channels, 1, network_args.MAX_IMG_CHANNELS)
        network_args.integer("label_dim", label_dim, 0, network_args.MAX_LABELS)
        network_args.integer("model_channels", model_channels, 1, network_args.MAX_CHANNELS)
        network_args.real("dropout", dropout, 0, 1)
        network_args.check_hyperparameters(MPResNetHyperparameters, dict(depth=depth))
        super().__init__()
        self.out_gain = torch.nn.Parameter(torch.zeros([]))
        self.emb_fourier = MPFourier(model_channels)
        self.emb_noise = MPConv(model_channels, model_channels, [])
        self.emb_label = MPConv(label_dim, model_channels, []) if label_dim else None
        self.conv_in = MPConv(img_channels + 1, model_channels, [3, 3])
        self.blocks = torch.nn.ModuleList(Block(model_channels, model_channels, model_channels, dropout=dropout)
                                          for _ in range(depth))
        self.conv_out = MPConv(model_channels, img_channels, [3, 3])

    def forward(self, x: torch.Tensor, noise_labels: torch.Tensor, class_labels: torch.Tensor | None) -> torch.Tensor:
        """F(x; c_noise, labels), the embedding as the U-Net's (Eq. 75, 88, 81)."""
        emb = self.emb_noise(self.emb_fourier(noise_labels))
        if self.emb_label is not None:
            emb = mp_sum(emb, self.emb_label(class_labels * math.sqrt(class_labels.shape[1])), t=0.5)
        emb = mp_silu(emb)
        x = self.conv_in(torch.cat([x, torch.ones_like(x[:, :1])], dim=1))
        for block in self.blocks:
            x = block(x, emb)
        return self.conv_out(x, gain=self.out_gain)


FAMILY = register(NetworkFamily(
    name="mp-resnet", constructor=MPResNet, hyperparameters=MPResNetHyperparameters,
    blocks=lambda net: [(f"block{i}", block) for i, block in enumerate(net.blocks)],
    summary="the U-Net's blocks at one resolution, no skips (docs/extending.md's example)"))
