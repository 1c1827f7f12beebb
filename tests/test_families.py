"""edm2.families: the registry of network families, and Precond building the family it names."""

import dataclasses
import inspect
import json
import re

import click
import pytest
import torch
from click.testing import CliRunner

import edm2.architectures  # noqa: F401  (every family registered)
from cli.network_options import given_hyperparameters, hyperparameter_names, hyperparameter_options, option_type
from edm2 import families
from edm2.families import NetworkFamily, UnknownFamily
from edm2.network_args import IntegerBound, IntegersBound, hyperparameter
from edm2.networks import UNET, Block, Precond, UNet, unet_blocks
from tests.helpers import tiny_precond
from edm2.encoders import StandardRGBEncoder
from training.architecture import InitSnapshot, NetworkMisfit, check_init, network_options
from training.presets import get_preset


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


def test_precond_holds_the_familys_network_under_the_release_name():
    net = tiny_precond()
    assert net.network is net.unet
    # The release's pickles, our snapshots, EMA tracks and training states all name its parameters 'unet.*'.
    assert all(k.startswith(("unet.", "logvar_")) for k in net.state_dict()) and "unet.out_gain" in net.state_dict()


@dataclasses.dataclass(frozen=True)
class WidthHyperparameters:
    width: int = hyperparameter(3, IntegerBound(1, 5), "Width of the test family")
    levels: tuple[int, ...] = hyperparameter((2,), IntegersBound(1, 9, 0, 2), "Levels of the test family")


class Wide(torch.nn.Module):
    def __init__(self, img_resolution, img_channels, label_dim, model_channels=1, dropout=0.0,
                 width=WidthHyperparameters.width, levels=WidthHyperparameters.levels):
        super().__init__()
        self.width, self.levels = width, levels

    def forward(self, x, noise_labels, class_labels):
        return x


@pytest.fixture
def wide(monkeypatch):
    """A family 'test-wide' with hyperparameters of its own, registered for one test only."""
    monkeypatch.setattr(families, "_REGISTRY", dict(families._REGISTRY))
    return families.register(NetworkFamily("test-wide", Wide, blocks=lambda net: [],
                                           hyperparameters=WidthHyperparameters))


def test_a_familys_hyperparameters_become_options_with_their_bounds_and_help(wide):
    @click.command()
    @hyperparameter_options
    def command(**values):
        click.echo(json.dumps(given_hyperparameters(values)))

    assert {"width", "levels", "num_blocks", "depth"} <= set(hyperparameter_names())
    result = CliRunner().invoke(command, ["--width=4", "--levels="])
    assert result.exit_code == 0, result.output
    given = json.loads(result.output)
    assert (given["width"], given["levels"], given["num_blocks"], given["depth"]) == (4, [], None, None)
    result = CliRunner().invoke(command, ["--help"])
    assert "Width of the test family; network families test-wide [default: preset, else 3] [1<=x<=5]" in " ".join(
        result.output.split())
    result = CliRunner().invoke(command, ["--width=6"])
    assert result.exit_code == 2 and "Invalid value for '--width': 6 is not in the range 1<=x<=5" in result.output
    # The chosen family's own bounds (here the list's length) are the dataclass's too.
    network = network_options(get_preset("toy-tiny"), dict(width=5, levels=(1,), num_blocks=None), "test-wide")
    assert network == dict(width=5, levels=(1,), family="test-wide")
    with pytest.raises(NetworkMisfit, match=r"^--levels=1,2,3: expected a list of 0 to 2 integers$"):
        network_options(get_preset("toy-tiny"), dict(levels=(1, 2, 3)), "test-wide")
    with pytest.raises(NetworkMisfit, match="--num-blocks does not shape the network family 'test-wide', which takes "
                                            "--width, --levels$"):
        network_options(get_preset("toy-tiny"), dict(num_blocks=2), "test-wide")


def test_the_unets_hyperparameters_are_its_constructors_defaults_and_bounds():
    fields = UNET.fields()
    assert list(fields) == ["channel_mult", "num_blocks", "attn_resolutions", "channels_per_head", "text_attention",
                            "text_attention_kind"]
    unet, block = inspect.signature(UNet).parameters, inspect.signature(Block).parameters
    assert all(unet[name].default == fields[name].default for name in ("channel_mult", "num_blocks",
                                                                        "attn_resolutions", "text_attention_kind"))
    # A U-Net without text has no text attention; a text run's is the attention resolutions unless given.
    assert unet["text_attention"].default == ()
    assert fields["text_attention"].default == fields["attn_resolutions"].default
    assert block["channels_per_head"].default == fields["channels_per_head"].default == 64
    assert (fields["channel_mult"].default, fields["num_blocks"].default) == ((1, 2, 3, 4), 3)  # the release's
    for name, value in [("num_blocks", 65), ("channel_mult", [1] * 17), ("attn_resolutions", [0]),
                        ("text_attention_kind", "sideways")]:
        with pytest.raises(families.ArchitectureError, match=f"^{re.escape(name)}"):
            UNET.check({name: value})
        with pytest.raises(families.ArchitectureError, match=f"^{re.escape(name)}"):
            tiny_precond(**{name: value})


@pytest.mark.bad_input
@pytest.mark.parametrize("hyperparameters", [dict, WidthHyperparameters(), type("Plain", (), {}),
                                             dataclasses.make_dataclass("Unbounded", [("depth", int, 3)])])
def test_a_familys_hyperparameters_must_be_a_dataclass_of_bounded_fields(hyperparameters, monkeypatch):
    monkeypatch.setattr(families, "_REGISTRY", dict(families._REGISTRY))
    with pytest.raises(families.ArchitectureError, match="'test-bad': its hyperparameters must be a dataclass of "
                                                         "edm2.network_args.hyperparameter fields"):
        families.register(NetworkFamily("test-bad", Wide, blocks=lambda net: [], hyperparameters=hyperparameters))


@pytest.mark.bad_input
def test_an_option_of_another_family_than_the_init_snapshots_is_one_line():
    unet = InitSnapshot("/runs/init.safetensors", tiny_precond().init_kwargs, StandardRGBEncoder())
    data = dict(resolution=8, num_channels=3, label_dim=10, encoder=StandardRGBEncoder())
    check_init(unet, **data, given=dict(channels=16, num_blocks=1, depth=None))  # the snapshot's own: fine
    with pytest.raises(NetworkMisfit, match="^--depth does not shape init.safetensors, a network of family 'edm2'; "
                                            "leave it out$"):
        check_init(unet, **data, given=dict(channels=None, depth=3))
    resnet = InitSnapshot("/runs/init.safetensors", Precond(8, 3, 10, family="mp-resnet", depth=2).init_kwargs,
                          StandardRGBEncoder())
    check_init(resnet, **data, given=dict(depth=2, num_blocks=None))
    with pytest.raises(NetworkMisfit, match="^--depth=3 contradicts init.safetensors, whose network has 2"):
        check_init(resnet, **data, given=dict(depth=3))
    with pytest.raises(NetworkMisfit, match="^--num-blocks does not shape init.safetensors, a network of family "
                                            "'mp-resnet'"):
        check_init(resnet, **data, given=dict(num_blocks=3))


def test_families_sharing_an_option_name_share_an_option_that_admits_each_ones_values():
    def family(name, bound):
        fields = [("width", int, hyperparameter(3, bound, "Width"))]
        return NetworkFamily(name, Wide, blocks=lambda net: [],
                             hyperparameters=dataclasses.make_dataclass(f"H{len(name)}", fields, frozen=True))

    narrow, wide = family("narrow", IntegerBound(1, 5)), family("broad", IntegerBound(2, 8))
    kind = option_type("width", [narrow, wide])
    assert (kind.min, kind.max) == (1, 8)
    lists = option_type("width", [family("a", IntegersBound(1, 4, 1, 3)), family("bb", IntegersBound(0, 2, 0, 1))])
    assert (lists.min, lists.max, lists.allow_empty) == (0, 4, True)
    with pytest.raises(families.ArchitectureError, match="declare width as different kinds of values"):
        option_type("width", [narrow, family("c", IntegersBound(1, 4, 1, 3))])
