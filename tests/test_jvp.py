"""Forward-mode AD through the network (torch.func.jvp, as sCM, MeanFlow and ECT take it): in training mode after
the explicit Eq. 66 step, float32 and float64, with and without activation checkpointing, whatever layout attention
arrives in and by either route it takes, agreeing with central finite differences."""

import re

import pytest
import torch

import edm2.layers
from edm2.layers import force_weight_normalization
from edm2.runtime.speed import to_channels_last
from tests.helpers import ATTENTION_ROUTES, REPO, randomized, take_attention_route, tiny_precond

# The layouts q, k, v arrive in: a channels-last network's are channels-adjacent.
LAYOUTS = ["contiguous", "channels-last"]


def network(dtype, checkpoint, layout="contiguous"):
    """A tiny trained-looking Precond in training mode, its stored weights normalized (Eq. 66) beforehand."""
    net = randomized(tiny_precond(dropout=0)).to(dtype).train()
    net.unet.checkpoint_blocks = checkpoint
    if layout == "channels-last":
        to_channels_last(net)
    force_weight_normalization(net)
    return net


def inputs(dtype, layout="contiguous"):
    """(x, sigma, labels, dx, dsigma): the same values in every dtype (drawn in float64, then rounded) and layout."""
    generator = torch.Generator().manual_seed(1)
    x, dx = torch.randn([2, 2, 3, 8, 8], generator=generator, dtype=torch.float64)
    if layout == "channels-last":
        x, dx = (t.contiguous(memory_format=torch.channels_last) for t in (x, dx))
    sigma, dsigma = torch.tensor([0.3, 2.0]), torch.tensor([0.2, -0.5])
    labels = torch.eye(10)[[1, 7]]
    return tuple(t.to(dtype) for t in (x, sigma, labels, dx, dsigma))


def jvp(net, dtype, layout="contiguous"):
    """d/dt of (D, u) at t = 0 along x + t dx, sigma + t dsigma, by torch.func.jvp."""
    x, sigma, labels, dx, dsigma = inputs(dtype, layout)
    return torch.func.jvp(lambda x, s: net(x, s, labels, return_logvar=True), (x, sigma), (dx, dsigma))


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("route", ATTENTION_ROUTES)
def test_jvp_through_the_network_agrees_with_central_differences(monkeypatch, route, layout, checkpoint):
    take_attention_route(monkeypatch, route)
    net = network(torch.float64, checkpoint, layout)
    x, sigma, labels, dx, dsigma = inputs(torch.float64, layout)
    (out, logvar), (tangent, logvar_tangent) = jvp(net, torch.float64, layout)
    # The primal outputs are the forward pass's (to float64 round-off: without tangents SDPA may take a fused
    # kernel, which sums in another order).
    with torch.no_grad():
        expected, expected_logvar = net(x, sigma, labels, return_logvar=True)
    torch.testing.assert_close((out, logvar), (expected, expected_logvar), rtol=1e-12, atol=1e-12)
    # Central differences err by O(h^2) (third derivatives of order 1 here) plus O(eps / h) of float64 round-off:
    # h = 1e-4 leaves ~1e-8, far below the tangents' order-1 values.
    h = 1e-4
    with torch.no_grad():
        plus = net(x + h * dx, sigma + h * dsigma, labels, return_logvar=True)
        minus = net(x - h * dx, sigma - h * dsigma, labels, return_logvar=True)
    for t, p, m in zip((tangent, logvar_tangent), plus, minus):
        assert t.abs().max() > 1e-2  # a tangent that matters
        torch.testing.assert_close(t, (p - m) / (2 * h), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("route", ATTENTION_ROUTES)
def test_jvp_in_float32_agrees_with_float64(monkeypatch, route, layout, checkpoint):
    take_attention_route(monkeypatch, route)
    reference = jvp(network(torch.float64, checkpoint, layout), torch.float64, layout)[1]
    tangents = jvp(network(torch.float32, checkpoint, layout), torch.float32, layout)[1]
    # float32 round-off (2^-24 per operation) through a few dozen layers of order-1 gains: ~1e-5 relative.
    for t, r in zip(tangents, reference):
        assert t.dtype == torch.float32
        torch.testing.assert_close(t.double(), r, rtol=1e-4, atol=1e-4 * r.abs().max().item())


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_a_gradient_through_the_jvp_reaches_the_weights(checkpoint):
    """A loss built from the tangent backpropagates to the weights, also with --checkpoint-activations (which then
    keeps the jvp's activations: a replay in the backward pass would lack the tangents)."""
    net = network(torch.float64, checkpoint)
    _, tangents = jvp(net, torch.float64)
    sum(t.square().sum() for t in tangents).backward()
    missing = [name for name, p in net.named_parameters() if p.grad is None or not p.grad.isfinite().all()]
    assert not missing
    assert all(p.grad.abs().sum() > 0 for p in net.parameters())


def test_the_readmes_jvp_lines_run_as_written():
    block = next(b for b in re.findall(r"```python\n(.*?)```", (REPO / "docs" / "api.md").read_text(), flags=re.S)
                 if "torch.func.jvp" in b)
    net = randomized(tiny_precond(dropout=0)).double().train()
    x, sigma, labels, dx, dsigma = inputs(torch.float64)
    namespace = dict(torch=torch, edm2=edm2, net=net, x=x, sigma=sigma, labels=labels, dx=dx, dsigma=dsigma)
    exec(compile(block, "docs/api.md", "exec"), namespace)
    expected = jvp(network(torch.float64, checkpoint=False), torch.float64)
    torch.testing.assert_close((namespace["d"], namespace["u"]), expected[0], rtol=0, atol=0)
    torch.testing.assert_close((namespace["dd"], namespace["du"]), expected[1], rtol=0, atol=0)
