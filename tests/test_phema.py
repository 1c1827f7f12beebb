"""Power-function EMA: sigma_rel <-> gamma and the training-time tracker against Eq. 1 in float64."""

import io

import numpy as np
import pytest
import torch

from edm2 import phema


class Toy(torch.nn.Module):
    """Two parameter tensors and a buffer, enough to exercise every code path of the tracker."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))
        self.b = torch.nn.Parameter(torch.randn(5))
        self.register_buffer("freqs", torch.randn(6))


def train_steps(net, ema, nimg, batch_sizes, gen):
    """Random-walk 'optimizer steps' followed by EMA updates; returns the float64 weights after each."""
    history = []
    for batch_size in batch_sizes:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=gen) + 0.3)
            net.freqs.add_(1.0)
        nimg += batch_size
        ema.update(cur_nimg=nimg, batch_size=batch_size)
        history.append((nimg, [p.detach().double().clone() for p in net.parameters()]))
    return nimg, history


def test_std_exp_conversions_match_paper():
    # Section 3.1/3.2: sigma_rel 0.05 and 0.10 <-> gamma 16.97 and 6.94.
    assert phema.std_to_exp(0.05) == pytest.approx(16.97, abs=0.005)
    assert phema.std_to_exp(0.10) == pytest.approx(6.94, abs=0.005)
    stds = np.linspace(0.005, 0.285, 57).reshape(3, 19)
    exps = phema.std_to_exp(stds)
    assert exps.shape == stds.shape and np.all(exps > 0)
    # Eq. 123 computed independently as the std of Beta(gamma + 1, 1) (Appendix C.4).
    a = exps + 1
    assert np.allclose(np.sqrt(a / ((a + 1) ** 2 * (a + 2))), stds, rtol=1e-12)
    assert np.allclose(phema.exp_to_std(exps), stds, rtol=1e-12)
    for bad in (0.0, -0.1, 0.2887, 0.3):
        with pytest.raises(ValueError):
            phema.std_to_exp(bad)


def test_beta_is_eq_127():
    gamma = phema.std_to_exp(0.1)
    assert phema.power_function_beta(0.1, t_next=4096, t_delta=2048) == pytest.approx(0.5 ** (gamma + 1), rel=1e-12)
    assert phema.power_function_beta(0.1, t_next=2048, t_delta=2048) == 0.0


def test_tracks_equal_eq_1_in_float64():
    # The tracker treats theta as piecewise constant, theta(tau) = theta_k for t_{k-1} < tau <= t_k
    # (Appendix C.3), so by Eq. 1 each track must equal
    #   sum_k theta_k * int_{t_{k-1}}^{t_k} tau^g dtau / int_0^{t_n} tau^g dtau.
    # Brute force: evaluate both integrals as sums of tau^g over a fine midpoint grid of every step.
    gen = torch.Generator().manual_seed(1)
    net = Toy()
    stds = (0.05, 0.10, 0.20)
    ema = phema.PowerFunctionEMA(net, stds=stds)
    batch_sizes = [8] * 40 + [3] * 5 + [8] * 14 + [5]
    _, history = train_steps(net, ema, 0, batch_sizes, gen)
    tracks = ema.get()
    assert [std for _, std in tracks] == list(stds)
    for track, std in tracks:
        gamma = float(phema.std_to_exp(std))
        num = [torch.zeros_like(p) for p in history[0][1]]
        den = 0.0
        t_prev = 0
        for t, theta in history:
            tau = t_prev + (np.arange(400) + 0.5) * (t - t_prev) / 400
            weight = float(np.sum(tau**gamma) * (t - t_prev) / 400)
            num = [n + weight * p for n, p in zip(num, theta)]
            den += weight
            t_prev = t
        for p_ema, n in zip(track.parameters(), num):
            assert p_ema.dtype == torch.float32
            torch.testing.assert_close(p_ema.double(), n / den, rtol=2e-6, atol=2e-5)
        # Buffers are copied from the network, not averaged.
        assert torch.equal(track.freqs, net.freqs)
    # Sanity of the reference itself: a long EMA differs clearly from the last weights.
    assert not torch.allclose(tracks[2][0].w.double(), history[-1][1][0], atol=1e-2)


def test_resume_is_exact():
    gen = torch.Generator().manual_seed(2)
    net = Toy()
    ema = phema.PowerFunctionEMA(net)
    nimg, _ = train_steps(net, ema, 0, [16] * 30, gen)
    buf = io.BytesIO()
    torch.save({"net": net.state_dict(), "ema": ema.state_dict()}, buf)
    nimg_a, _ = train_steps(net, ema, nimg, [16] * 20, torch.Generator().manual_seed(3))

    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    net_b = Toy()
    net_b.load_state_dict(state["net"])
    ema_b = phema.PowerFunctionEMA(net_b)
    ema_b.load_state_dict(state["ema"])
    nimg_b, _ = train_steps(net_b, ema_b, nimg, [16] * 20, torch.Generator().manual_seed(3))
    assert nimg_a == nimg_b
    for (a, std_a), (b, std_b) in zip(ema.get(), ema_b.get()):
        assert std_a == std_b
        for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(ta, tb), name

    with pytest.raises(ValueError, match="sigma_rel"):
        phema.PowerFunctionEMA(Toy(), stds=(0.05,)).load_state_dict(state["ema"])


def test_tracker_does_not_touch_network_or_track_grads():
    net = Toy()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    ema = phema.PowerFunctionEMA(net)
    ema.update(cur_nimg=4, batch_size=4)
    ema.get()
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(not p.requires_grad for track, _ in ema.get() for p in track.parameters())
    assert all(p.requires_grad for p in net.parameters())
