"""The evaluation-mode weight cache of MPConv: bitwise the uncached computation, computed once, and recomputed after
every way the weights can change."""

import copy

import pytest
import torch

from edm2.layers import MPConv
from edm2.phema import PowerFunctionEMA
from edm2.speed import to_channels_last
from tests.helpers import bits, randomized, tiny_precond

X, SIGMA, LABELS = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0.3, 1.0, 4.0]), \
    torch.eye(10)[:3]


def convs(net):
    return [m for m in net.modules() if isinstance(m, MPConv)]


def cached(net):
    """The output with the cache in use (evaluation mode, no gradient)."""
    with torch.no_grad():
        return net.eval()(X.to(net.base_dtype()), SIGMA, LABELS)


def uncached(net):
    """The same output computed from the weights as they are now: recording gradients bypasses the cache."""
    with torch.enable_grad():
        return net.eval().requires_grad_(True)(X.to(net.base_dtype()), SIGMA, LABELS).detach()


def bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def test_cached_weights_are_computed_once_and_give_the_same_bits(monkeypatch):
    net = randomized(tiny_precond())
    calls = []
    original = MPConv.effective_weight
    monkeypatch.setattr(MPConv, "effective_weight", lambda self, *a: calls.append(self) or original(self, *a))
    used = len(convs(net.unet))  # without return_logvar, the log-variance head is not evaluated
    first = cached(net)
    assert len(calls) == used
    second = cached(net)
    assert len(calls) == used  # nothing recomputed
    assert bits_equal(first, second) and bits_equal(first, uncached(net))
    assert len(calls) == 2 * used  # the gradient-recording call computed its own


def change_weight(net):
    with torch.no_grad():
        net.unet.enc["8x8_block0"].conv_res0.weight.mul_(-1.5)


def change_gain(net):
    with torch.no_grad():
        net.unet.enc["8x8_block0"].emb_gain.fill_(0.3)


def load_other(net):
    net.load_state_dict(randomized(tiny_precond(), seed=5).state_dict())


def train_forward(net):
    net.train()(X, SIGMA, LABELS)  # forced weight normalization rewrites every weight in place
    net.eval()


def adam_step(net):
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1, foreach=True)
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()


def ema_of(net):
    tracker = PowerFunctionEMA(net, stds=(0.1,))
    ema = tracker.emas[0]
    cached(ema)  # fill the EMA's cache, then let the tracker move it
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1)
    tracker.update(cur_nimg=64, batch_size=32)
    return ema


def assign_data(net):
    weight = net.unet.out_conv.weight
    weight.data = weight.data * 2  # a new storage: the data pointer changes


@pytest.mark.parametrize("change", [change_weight, change_gain, load_other, train_forward, adam_step, assign_data])
def test_cache_follows_every_change_of_the_weights(change):
    net = randomized(tiny_precond())
    before = cached(net)
    change(net)
    after = cached(net)
    assert not torch.equal(after, before)
    assert bits_equal(after, uncached(net))


def test_cache_follows_the_ema_tracker_and_dtype_device_and_format_changes():
    net = randomized(tiny_precond())
    ema = ema_of(net)
    assert bits_equal(cached(ema), uncached(ema))
    cached(net)
    double = net.double()  # .to(dtype): a float64 network computes in float64 with float64 weights
    assert all(conv._cached is None for conv in convs(double))
    assert cached(double).dtype == torch.float64 and bits_equal(cached(double), uncached(double))
    cached(net.float())
    to_channels_last(net)
    assert all(conv._cached is None for conv in convs(net))
    assert bits_equal(cached(net), uncached(net))
    cached(net)
    meta = copy.deepcopy(net).to("meta")  # any .to(device)
    assert all(conv._cached is None for conv in convs(meta))
    assert any(conv._cached is not None for conv in convs(net.eval()))  # eval() keeps it; training frees it
    assert all(conv._cached is None for conv in convs(net.train()))


def test_no_cache_while_gradients_are_recorded_or_for_inference_tensors():
    net = randomized(tiny_precond()).eval()
    for _ in range(2):  # a cached weight would make the second backward reuse the first graph's freed buffers
        net(X, SIGMA, LABELS).square().sum().backward()
    assert all(conv._cached is None for conv in convs(net))
    with torch.inference_mode():
        frozen = randomized(tiny_precond()).eval()
        out = frozen(X, SIGMA, LABELS)
    assert all(conv._cached is None for conv in convs(frozen))  # inference tensors keep no version counter
    with torch.inference_mode():
        assert torch.equal(frozen(X, SIGMA, LABELS), out)
