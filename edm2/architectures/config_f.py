"""The paper's CONFIG F (Figure 21, Appendix B.6): the U-Net of CONFIG G before its fixed-function layers were made
magnitude-preserving (Appendix B.7 lists what G changed; F has the plain layers):
- Fourier features cos(2 pi (f a + phi)) (Eq. 35), without G's sqrt(2) (Eq. 75);
- plain SiLU, not divided by 0.596 (Eq. 81);
- plain sums of the residual and attention branches and of the noise and class embeddings, not G's weighted sums
  (Eq. 88), and a plain concatenation of the U-Net skips, not Eq. 103;
- no learned gains: the conditioning is on at initialization, and the output layer applies its weight as it is.
What F introduced over E is G's too: no group norms, pixel norm (Eq. 30) at the start of every encoder block, the
1x1 convolution at the start of the encoder blocks' main path, resampling on the main path, one embedding layer,
no SiLU before the output layer. The learned layers are E's (Eq. 47, forced weight normalization Eq. 66); the
activation clipping and the block options are G's. State-dict names are G's less the gains.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edm2 import families
from edm2.layers import FourierFeatures
from edm2.network_args import UNetHyperparameters
from edm2.networks import Block, UNet, unet_blocks


def plain_sum(a: torch.Tensor, b: torch.Tensor, t: float = 0.5) -> torch.Tensor:
    """a + b: CONFIG F adds its branches (t, G's balance in Eq. 88, is not used)."""
    return a + b


def plain_cat(a: torch.Tensor, b: torch.Tensor, dim: int = 1, t: float = 0.5) -> torch.Tensor:
    """torch.cat([a, b], dim): CONFIG F concatenates its skips as they are (t, G's balance in Eq. 103, is not used)."""
    return torch.cat([a, b], dim=dim)


def drop_gain(module: torch.nn.Module, name: str) -> None:
    """Replace the learned gain `name` by the constant 1 (a parameter G added in Appendix B.7)."""
    delattr(module, name)
    setattr(module, name, 1.0)


class FBlock(Block):
    """CONFIG F's encoder or decoder block: G's layout with plain SiLU and sums and no conditioning gain."""

    silu = staticmethod(F.silu)
    add = staticmethod(plain_sum)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        drop_gain(self, "emb_gain")


class FUNet(UNet):
    """The U-Net of CONFIG F (Figure 21)."""

    block_type = FBlock
    fourier_type = FourierFeatures
    silu = staticmethod(F.silu)
    add = staticmethod(plain_sum)
    cat = staticmethod(plain_cat)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        drop_gain(self, "out_gain")


FAMILY = families.register(families.NetworkFamily(
    name="config-f", constructor=FUNet, blocks=unet_blocks, hyperparameters=UNetHyperparameters,
    summary="the paper's CONFIG F: G's U-Net with plain SiLU, sums and concatenation, no gains, Eq. 35 features"))
