"""weights_normalized_once, the one place where a normalized weight is reused: bitwise the computation on every call,
each layer normalized once per entry, dropped on exit, and every way the weights can change seen by the next entry."""

import copy
import weakref

import pytest
import torch

from edm2 import layers
from edm2.eval.validation import loss_per_sigma, validation_loss
from edm2.layers import mpconvs, weights_normalized_once
from edm2.loss import EDM2Loss
from edm2.phema import PowerFunctionEMA
from edm2.runtime.speed import to_channels_last
from edm2.sampler import edm_sampler
from tests.helpers import bits, randomized, tiny_precond

X, SIGMA, LABELS = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0.3, 1.0, 4.0]), \
    torch.eye(10)[:3]


def prepared(net):
    """The output with each weight normalized once, on entry."""
    with weights_normalized_once(net):
        return net.eval()(X.to(net.base_dtype()), SIGMA, LABELS)


def per_call(net):
    """The same output with every layer normalizing its weight as it is called."""
    with torch.no_grad():
        return net.eval()(X.to(net.base_dtype()), SIGMA, LABELS)


def bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def count_normalizations(monkeypatch):
    """The layers' weights normalized from now on, one entry per normalization."""
    calls = []
    original = layers.normalized_weight
    monkeypatch.setattr(layers, "normalized_weight", lambda weight: calls.append(weight) or original(weight))
    return calls


def test_each_weight_is_normalized_once_per_entry_and_gives_the_same_bits(monkeypatch):
    net = randomized(tiny_precond())
    want = per_call(net)
    calls = count_normalizations(monkeypatch)
    with weights_normalized_once(net):
        assert len(calls) == len(mpconvs(net))  # every layer, the log-variance head included
        first, second = (net.eval()(X, SIGMA, LABELS) for _ in range(2))
    assert len(calls) == len(mpconvs(net))  # the calls normalized nothing
    assert bits_equal(first, want) and bits_equal(second, want)


def test_the_sampler_normalizes_each_weight_of_both_networks_once_per_run(monkeypatch):
    net, gnet = randomized(tiny_precond()).eval(), randomized(tiny_precond(), seed=2).eval()
    noise = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    calls = count_normalizations(monkeypatch)
    edm_sampler(net, noise, LABELS[:2], gnet=gnet, guidance=2.0, num_steps=4)
    assert len(calls) == len(mpconvs(net)) + len(mpconvs(gnet))
    assert all(layer.normalized_once is None for layer in mpconvs(net, gnet))


class FixedSamples:
    """ValidationSamples' interface over the fixed batch X: y, sigma, n and labels of the samples asked for."""

    num = len(X)
    loss = EDM2Loss()

    def batch(self, samples, device):
        return X[samples], SIGMA[samples].reshape(-1, 1, 1, 1), X.flip(0)[samples], LABELS[samples]


def test_the_validation_loss_and_the_loss_per_sigma_normalize_each_weight_once_per_call(monkeypatch):
    net = randomized(tiny_precond()).eval()
    calls = count_normalizations(monkeypatch)
    validation_loss(net, FixedSamples(), batch_size=1)  # three batches
    assert len(calls) == len(mpconvs(net))
    loss_per_sigma(net, X, X.flip(0), LABELS, [0.5, 1.0, 2.0], EDM2Loss())
    assert len(calls) == 2 * len(mpconvs(net))
    assert all(layer.normalized_once is None for layer in mpconvs(net))


def test_the_normalized_weights_are_dropped_on_exit_even_after_an_error():
    net = randomized(tiny_precond())
    with weights_normalized_once(net):
        held = [weakref.ref(layer.normalized_once) for layer in mpconvs(net)]
    assert all(layer.normalized_once is None for layer in mpconvs(net))
    assert all(ref() is None for ref in held)  # nothing else keeps them: their memory is free
    with pytest.raises(RuntimeError), weights_normalized_once(net):
        net(X[:, :2], SIGMA, LABELS)  # two channels where the network takes three
    assert all(layer.normalized_once is None for layer in mpconvs(net))


def test_a_nested_entry_leaves_the_outer_ones_weights():
    net, other = randomized(tiny_precond()), randomized(tiny_precond(), seed=4)
    with weights_normalized_once(net):
        outer = [layer.normalized_once for layer in mpconvs(net)]
        with weights_normalized_once(net, other):
            assert all(layer.normalized_once is w for layer, w in zip(mpconvs(net), outer))
            assert all(layer.normalized_once is not None for layer in mpconvs(other))
        assert all(layer.normalized_once is w for layer, w in zip(mpconvs(net), outer))
        assert all(layer.normalized_once is None for layer in mpconvs(other))


def change_weight(net):
    with torch.no_grad():
        net.unet.enc["8x8_block0"].conv_res0.weight.mul_(-1.5)


def change_gain(net):
    with torch.no_grad():
        net.unet.enc["8x8_block0"].emb_gain.fill_(0.3)


def load_other(net):
    net.load_state_dict(randomized(tiny_precond(), seed=5).state_dict())


def forced_normalization(net):
    layers.force_weight_normalization(net)  # Eq. 66 rewrites every weight in place


def adam_step(net):
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1, foreach=True)
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()


def assign_data(net):
    weight = net.unet.out_conv.weight
    weight.data = weight.data * 2  # a new storage


@pytest.mark.parametrize("change", [change_weight, change_gain, load_other, forced_normalization, adam_step,
                                    assign_data])
def test_the_next_entry_sees_every_change_of_the_weights(change):
    net = randomized(tiny_precond())
    before = prepared(net)
    change(net)
    after = prepared(net)
    assert not torch.equal(after, before)
    assert bits_equal(after, per_call(net))


def test_a_change_within_an_entry_waits_for_the_next_one():
    net = randomized(tiny_precond()).eval()
    before = per_call(net)
    with weights_normalized_once(net):
        change_weight(net)
        assert bits_equal(net(X, SIGMA, LABELS), before)  # the weights as they were on entry, as documented
    assert bits_equal(prepared(net), per_call(net)) and not torch.equal(prepared(net), before)


def test_the_ema_tracker_and_dtype_device_and_format_changes_are_seen():
    net = randomized(tiny_precond())
    tracker = PowerFunctionEMA(net, stds=(0.1,))
    ema = tracker.emas[0]
    prepared(ema)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1)
    tracker.update(cur_nimg=64, batch_size=32)
    assert bits_equal(prepared(ema), per_call(ema))
    double = net.double()  # a float64 network computes in float64 with float64 weights
    assert prepared(double).dtype == torch.float64 and bits_equal(prepared(double), per_call(double))
    to_channels_last(net.float())
    assert bits_equal(prepared(net), per_call(net))
    meta = copy.deepcopy(net).to("meta")  # any .to(device)
    with weights_normalized_once(meta):
        assert all(layer.normalized_once.device.type == "meta" for layer in mpconvs(meta))


def test_no_gradients_within_an_entry_and_every_backward_outside_computes_its_own():
    net = randomized(tiny_precond()).eval()
    for _ in range(2):  # a weight reused across graphs would make the second backward reuse freed buffers
        net(X, SIGMA, LABELS).square().sum().backward()
    with weights_normalized_once(net):
        assert not net(X, SIGMA, LABELS).requires_grad
    assert all(layer.normalized_once is None for layer in mpconvs(net))
    with torch.inference_mode():
        frozen = randomized(tiny_precond()).eval()
        want = frozen(X, SIGMA, LABELS)
        with weights_normalized_once(frozen):
            assert bits_equal(frozen(X, SIGMA, LABELS), want)
