"""edm2.families: the registry of network families, and Precond building the family it names."""

import pytest
import torch

import edm2.architectures  # noqa: F401  (every family registered)
from edm2 import families
from edm2.families import NetworkFamily, UnknownFamily
from edm2.networks import UNET, Precond, UNet, unet_blocks
from tests.helpers import tiny_precond


def test_the_release_unet_is_the_default_family():
    assert families.get("edm2") is UNET and families.DEFAULT_FAMILY == "edm2"
    assert UNET.constructor is UNet and "edm2" in families.names()
    net = tiny_precond()
    assert type(net.unet) is UNet and net.family is UNET and net.init_kwargs["family"] == "edm2"
    assert families.family_of({}) is UNET and families.family_of(net.init_kwargs) is UNET


def test_blocks_are_the_unets_blocks_in_evaluation_order():
    net = tiny_precond()
    names = [name for name, _ in unet_blocks(net.unet)]
    expected = [f"enc.{n}" for n in net.unet.enc if not n.endswith("_conv")] + [f"dec.{n}" for n in net.unet.dec]
    assert names == expected
    order = []
    hooks = [m.register_forward_hook(lambda m, i, o, name=name: order.append(name)) for name, m in unet_blocks(net.unet)]
    net(torch.zeros(1, 3, 8, 8), 1.0)
    for hook in hooks:
        hook.remove()
    assert order == names


def test_precond_builds_the_family_it_names():
    class Zero(torch.nn.Module):
        def __init__(self, img_resolution, img_channels, label_dim, model_channels=1, dropout=0.0, scale=1.0):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(float(scale)))

        def forward(self, x, noise_labels, class_labels):
            return x * 0 * self.scale

    family = families.register(NetworkFamily("test-zero", Zero, blocks=lambda net: []))
    assert families.register(family) is family  # the same record again is no second family
    net = Precond(8, 3, 10, family="test-zero", model_channels=2, scale=3.0)
    assert type(net.unet) is Zero and net.unet.scale.item() == 3.0 and net.init_kwargs["family"] == "test-zero"
    x, sigma = torch.randn(2, 3, 8, 8), torch.tensor([0.5, 2.0])
    # F = 0 leaves the skip path of Eq. 7: D(x) = c_skip(sigma) x.
    torch.testing.assert_close(net(x, sigma), 0.25 / (sigma**2 + 0.25).reshape(-1, 1, 1, 1) * x)
    with pytest.raises(families.ArchitectureError, match="already registered"):
        families.register(NetworkFamily("test-zero", UNet, blocks=unet_blocks))


@pytest.mark.bad_input
@pytest.mark.parametrize("name", ["no-such-family", 3, "x" * 500])
def test_an_unknown_family_is_one_line_naming_it_and_the_known_ones(name):
    with pytest.raises(UnknownFamily) as error:
        tiny_precond(family=name)
    message = str(error.value)
    assert "\n" not in message and "unknown network family" in message and "edm2" in message
    assert (repr(name) in message) if name == "no-such-family" else len(message) < 200
