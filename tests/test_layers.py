"""Magnitude-preserving primitives against their definitions (paper Appendix B.7)."""

import math

import numpy as np
import pytest
import scipy.integrate
import torch

from edm2.architectures.ladder import BiasedLayer, UniformConv
from edm2.layers import ArchitectureError, MPConv, MPFourier, mp_cat, mp_silu, mp_sum, normalize, resample

N = 1 << 20  # samples; the RMS of N unit normals has standard error sqrt(1/(2N)) ~ 7e-4


def rms(x: torch.Tensor) -> float:
    return x.to(torch.float64).square().mean().sqrt().item()


def test_normalize_is_algorithm1():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4, 4, dtype=torch.float64) * 7
    n = x.flatten(1).norm(dim=1).reshape(-1, 1, 1, 1)
    want = x / (1e-4 + n / math.sqrt(48))
    torch.testing.assert_close(normalize(x), want)
    # Pixel norm over channels only.
    y = normalize(x, dim=1)
    torch.testing.assert_close(y.square().mean(1), torch.ones(5, 4, 4, dtype=torch.float64), rtol=1e-3, atol=0)


def test_mp_silu_constant_is_silu_rms():
    # 0.596 is sqrt(E[silu(x)^2]) for x ~ N(0,1), computed here by quadrature.
    density = lambda a: (a / (1 + np.exp(-a))) ** 2 * np.exp(-a * a / 2) / np.sqrt(2 * np.pi)
    assert abs(math.sqrt(scipy.integrate.quad(density, -40, 40)[0]) - 0.596) < 1e-3
    torch.manual_seed(0)
    assert abs(rms(mp_silu(torch.randn(N))) - 1) < 5e-3


@pytest.mark.parametrize("t", [0.3, 0.5, 0.9])
def test_mp_sum_unit_magnitude_and_formula(t):
    torch.manual_seed(0)
    a, b = torch.randn(N), torch.randn(N)
    assert abs(rms(mp_sum(a, b, t)) - 1) < 5e-3
    torch.testing.assert_close(mp_sum(a, b, t), ((1 - t) * a + t * b) / math.sqrt((1 - t) ** 2 + t**2))


@pytest.mark.parametrize("na,nb,t", [(16, 48, 0.5), (64, 8, 0.3)])
def test_mp_cat_unit_magnitude_and_balance(na, nb, t):
    torch.manual_seed(0)
    a, b = torch.randn(N // 64, na), torch.randn(N // 64, nb)
    y = mp_cat(a, b, dim=1, t=t)
    assert y.shape == (N // 64, na + nb)
    assert abs(rms(y) - 1) < 5e-3
    # Eq. 103: the two parts contribute in proportion (1-t)^2 : t^2 of the total energy.
    ea, eb = y[:, :na].square().sum().item(), y[:, na:].square().sum().item()
    assert abs(ea / eb - (1 - t) ** 2 / t**2) / ((1 - t) ** 2 / t**2) < 0.02


def test_mp_fourier_unit_magnitude():
    torch.manual_seed(0)
    fourier = MPFourier(4096)
    y = fourier(torch.randn(256))
    assert y.shape == (256, 4096)
    assert abs(rms(y) - 1) < 0.01
    x = torch.tensor([0.7])
    want = math.sqrt(2) * torch.cos(fourier.freqs * 0.7 + fourier.phases)
    torch.testing.assert_close(fourier(x)[0], want)


@pytest.mark.parametrize("kernel", [[], [1, 1], [3, 3]])
def test_mpconv_unit_magnitude(kernel):
    torch.manual_seed(0)
    conv = MPConv(64, 256, kernel).eval()
    x = torch.randn(64, 64) if not kernel else torch.randn(16, 64, 16, 16)
    with torch.no_grad():
        y = conv(x)
        # The weight's scale does not matter (Eq. 47) and the gain multiplies the output.
        conv.weight.mul_(5)
        # Rescaling changes only Algorithm 1's eps term, a 1e-4 relative effect.
        torch.testing.assert_close(conv(x, gain=2.0), 2 * y, rtol=3e-4, atol=1e-5)
    # Zero padding: a 3x3 tap sees the input at 2 of 3 offsets on each border row/column, so the
    # expected energy is the mean fraction of valid taps, (2*2 + 14*3) / (16*3) per axis.
    expected = (2 * 2 + 14 * 3) / (16 * 3) if kernel == [3, 3] else 1.0
    assert abs(rms(y) - expected) < 0.02


def test_resample_box_filter():
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    down = resample(x, "down")
    torch.testing.assert_close(down, torch.tensor([[[[2.5, 4.5], [10.5, 12.5]]]]))
    up = resample(down, "up")
    assert up.shape == (1, 1, 4, 4) and torch.equal(up[0, 0, :2, :2], torch.full((2, 2), 2.5))
    assert resample(x, "keep") is x
    with pytest.raises(ArchitectureError, match="sideways"):
        resample(x, "sideways")


@pytest.mark.parametrize("layer", [MPConv, UniformConv, BiasedLayer])
def test_interleaved_output_channels_come_out_regrouped_with_their_values(layer):
    # Attention asks its qkv layer for channels stored as [head, channel, (q,k,v)] grouped as [(q,k,v), head,
    # channel]: the same channels, each computed from its own weight row (and bias) as without regrouping.
    torch.manual_seed(0)
    qkv = layer(8, 3 * 8, [1, 1])
    x = torch.randn(2, 8, 5, 5)
    with torch.no_grad():
        stored, grouped = qkv(x), qkv(x, interleave=3)
    assert torch.equal(grouped, stored.reshape(2, 8, 3, 5, 5).transpose(1, 2).reshape(2, 24, 5, 5))


@pytest.mark.parametrize("mode", ["up", "down"])
def test_resample_keeps_a_channels_last_input_channels_last(mode):
    # Otherwise every elementwise op after an up block mixes NCHW and NHWC (a --channels-last step ran 25% slower).
    x = torch.randn(2, 5, 4, 4).contiguous(memory_format=torch.channels_last)
    y = resample(x, mode)
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, resample(x.contiguous(), mode), rtol=0, atol=0)
