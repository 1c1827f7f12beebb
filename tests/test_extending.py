"""docs/extending.md's examples, run end to end: the network family 'mp-resnet' (edm2/architectures/mp_resnet.py),
the data encoding 'linear-rgb' (edm2.encoders.LinearRGBEncoder), a second VAE ('diffusers-vae', a 16-channel
AutoencoderKL) and recorded encodings; and the one-line answers to a family or an encoding that is not registered."""

import json
import re

import pytest
import torch
from click.testing import CliRunner

import count_flops
import dataset_tool
import generate
import train_edm2
from edm2 import network_args
from edm2.architectures.mp_resnet import MPResNet, MPResNetHyperparameters
from edm2.data.dataset import ImageFolderDataset
from edm2.data.shards import ShardDataset
from edm2.encoders import DiffusersVAEEncoder, LinearRGBEncoder
from edm2.eval import flops
from edm2.formats.snapshot import load_generator, load_network
from edm2.networks import Precond, count_parameters
from tests.helpers import assert_refused, save_tiny_vae, write_image_dataset


def train(data, outdir, *args):
    return CliRunner().invoke(train_edm2.main, ["--preset=toy-tiny", f"--data={data}", f"--outdir={outdir}",
                                                "--workers=0", "--grid=0", *args])


def test_a_network_family_trains_saves_loads_samples_and_counts(train_data, tmp_path):
    # Two steps of 32 images, then a snapshot: the family's network, with its own --depth, goes through the whole run.
    result = train(train_data, tmp_path / "run", "--arch=mp-resnet", "--depth=2", "--duration=64",
                   "--batch=32", "--snapshot=64", "--checkpoint=64", "--status=32")
    assert result.exit_code == 0, result.output
    options = json.loads((tmp_path / "run" / "training_options.json").read_text())
    assert options["network"] == {"depth": 2, "family": "mp-resnet"}
    # The run's options read back: --depth and --arch from its network, the same run.
    result = CliRunner().invoke(train_edm2.main, [f"--config={tmp_path / 'run' / 'training_options.json'}",
                                                  "--dry-run"])
    assert result.exit_code == 0, result.output
    reread = json.loads(result.output[: result.output.rindex("}") + 1])
    assert reread == {k: v for k, v in options.items() if k != "run_id"}  # run_id: written by the run, not an option
    snapshot = sorted((tmp_path / "run").glob("network-snapshot-*.safetensors"))[0]
    net, metadata = load_network(snapshot)
    assert type(net.network) is MPResNet and len(net.network.blocks) == 2
    assert metadata["network_kwargs"]["family"] == "mp-resnet" and metadata["network_kwargs"]["depth"] == 2
    assert net.network.conv_in.weight.shape == (16, 4, 3, 3)

    out = tmp_path / "images"
    result = CliRunner().invoke(generate.main, [f"--net={snapshot}", f"--outdir={out}", "--seeds=0-2", "--steps=2",
                                                "--class=1"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.glob("*.png")) == ["000000.png", "000001.png", "000002.png"]

    result = CliRunner().invoke(count_flops.main, [str(snapshot), "--verbose"])
    assert result.exit_code == 0, result.output
    rows = dict(re.findall(r"^(block\d)\s+([0-9.]+)", result.output, flags=re.M))
    assert list(rows) == ["block0", "block1"]
    # The convolutions by hand: 8x8 pixels, 16 channels; 3x3 in (3 + 1 -> 16), two 3x3 per block, 3x3 out (16 -> 3).
    convolutions = 64 * 9 * (4 * 16 + 2 * 2 * 16 * 16 + 16 * 3)
    assert flops.count_flops(net).by_op()["_convolution"] == convolutions


def dry_run_network(result) -> tuple[dict, dict, int]:
    """The network arguments, the data's description and the parameter count that a --dry-run prints."""
    assert result.exit_code == 0, result.output
    options = json.loads(result.output[: result.output.rindex("}") + 1])
    count = int(re.search(r"Network: ([0-9,]+) parameters", result.output)[1].replace(",", ""))
    return options["network"], options["dataset"], count


def test_a_family_gets_its_own_defaults_not_the_presets_unet(train_data, tmp_path):
    # toy-tiny's row is of the U-Net (num_blocks=1, ...): none of its keys reaches mp-resnet, which keeps depth=4.
    network, data, count = dry_run_network(train(train_data, tmp_path / "run", "--arch=mp-resnet", "--dry-run"))
    assert network == {"family": "mp-resnet"}
    with torch.device("meta"):
        built = Precond(data["resolution"], 3, data["label_dim"], model_channels=16, family="mp-resnet")
    assert len(built.network.blocks) == MPResNetHyperparameters.depth == 4
    assert count == count_parameters(built)
    # The U-Net's configurations share its hyperparameters: toy-tiny's reach config-e.
    network, _, _ = dry_run_network(train(train_data, tmp_path / "run", "--arch=config-e", "--dry-run"))
    assert network == dict(channel_mult=[1, 2], num_blocks=1, attn_resolutions=[4], channels_per_head=16,
                           family="config-e")


@pytest.mark.bad_input
def test_an_unknown_network_family_is_one_line(train_data, tmp_path):
    assert_refused(tmp_path, lambda: train(train_data, tmp_path / "run", "--arch=dit-xl"), "--arch", "'dit-xl'",
                   "edm2", "mp-resnet")


@pytest.mark.bad_input
@pytest.mark.parametrize("args, line", [
    (["--arch=mp-resnet", "--channel-mult=1,2"],
     "--channel-mult does not shape the network family 'mp-resnet', which takes --depth"),
    (["--depth=3"], "--depth does not shape the network family 'edm2', which takes --channel-mult, --num-blocks, "
                    "--attn-resolutions, --channels-per-head"),
    (["--arch=config-e", "--depth=3"], "--depth does not shape the network family 'config-e'"),
], ids=["unet option for mp-resnet", "depth for the unet", "depth for config-e"])
def test_an_option_the_family_does_not_take_is_one_line(args, line, train_data, tmp_path):
    assert_refused(tmp_path, lambda: train(train_data, tmp_path / "run", *args), line)


@pytest.mark.bad_input
@pytest.mark.parametrize("value", ["0", "65"])
def test_the_bound_of_a_family_option_is_its_dataclass_field_s(value, train_data, tmp_path):
    bound = network_args.hyperparameter_fields(MPResNetHyperparameters)["depth"].metadata["bound"]
    assert (bound.low, bound.high) == (1, 64)
    assert_refused(tmp_path, lambda: train(train_data, tmp_path / "run", "--arch=mp-resnet", f"--depth={value}"),
                   "Invalid value for '--depth'", f"{value} is not in the range 1<=x<=64")


def recorded(path, **record):
    """A release-format dataset whose dataset.json also records these keys (an encoding)."""
    labels = json.loads((path / "dataset.json").read_text())
    (path / "dataset.json").write_text(json.dumps(dict(labels, **record)))
    return path


@pytest.mark.bad_input
def test_a_dataset_of_an_unknown_encoding_is_one_line(tmp_path):
    data = recorded(write_image_dataset(tmp_path / "data", num=16), encoding="dct-8x8")
    assert_refused(tmp_path, lambda: train(data, tmp_path / "run", "--dry-run"), "--data",
                   "the data encoding 'dct-8x8' is not registered", "pixels, stability-vae, diffusers-vae")


def test_a_recorded_encoding_is_taken_and_an_unrecorded_one_said_once(tmp_path):
    data = write_image_dataset(tmp_path / "release", num=16)  # the release's dataset.json: labels only
    result = train(data, tmp_path / "run", "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.output.count("records no encoding") == 1 and "taken as pixels" in result.output
    data = recorded(write_image_dataset(tmp_path / "ours", num=16), encoding="pixels")
    result = train(data, tmp_path / "run", "--dry-run")
    assert result.exit_code == 0 and "records no encoding" not in result.output
    assert json.loads(result.output[: result.output.rindex("}") + 1])["encoder"] == {"class": "StandardRGBEncoder"}


def test_a_data_encoding_is_written_trained_on_and_decoded(tmp_path):
    source = write_image_dataset(tmp_path / "source", num=16)
    data = tmp_path / "linear.zip"
    result = CliRunner().invoke(dataset_tool.main, ["convert", f"--source={source}", f"--dest={data}",
                                                    "--encoding=linear-rgb", '--encoding-settings={"gamma": 2.2}',
                                                    "--workers=0"])
    assert result.exit_code == 0, result.output
    result = train(data, tmp_path / "run", "--duration=32", "--batch=32", "--snapshot=32", "--checkpoint=32",
                   "--status=32")
    assert result.exit_code == 0, result.output
    assert "records no encoding" not in result.output
    snapshot = sorted((tmp_path / "run").glob("network-snapshot-*.safetensors"))[0]
    _, encoder, metadata = load_generator(snapshot)
    assert isinstance(encoder, LinearRGBEncoder) and metadata["encoder"] == {"class": "LinearRGBEncoder", "gamma": 2.2}
    out = tmp_path / "images"
    result = CliRunner().invoke(generate.main, [f"--net={snapshot}", f"--outdir={out}", "--seeds=0-1", "--steps=2"])
    assert result.exit_code == 0, result.output
    assert len(list(out.glob("*.png"))) == 2
    # Every 8-bit value comes back through linear light (float32 powers are off by far less than the 0.5 rounding).
    levels = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16)
    assert torch.equal(encoder.decode(encoder.encode(levels)), levels)
    assert encoder.encode(levels).min() == -1 and encoder.encode(levels).max() == 1


def test_a_second_vae_of_16_channels_encodes_to_zip_and_shards_trains_and_decodes(tmp_path):
    vae = save_tiny_vae(tmp_path / "vae16", latent_channels=16)
    result = CliRunner().invoke(dataset_tool.main, ["toy", f"--dest={tmp_path / 'toy.zip'}", "--resolution=16",
                                                    "--num=32", "--classes=2"])
    assert result.exit_code == 0, result.output
    settings = '{"latent_channels": 16, "raw_mean": 0.06, "raw_std": 0.65}'
    for dest in ["latents16.zip", "latents16.shards"]:
        result = CliRunner().invoke(dataset_tool.main, ["encode", f"--source={tmp_path / 'toy.zip'}",
                                                        f"--dest={tmp_path / dest}", "--encoding=diffusers-vae",
                                                        f"--vae={vae}", f"--encoding-settings={settings}",
                                                        "--workers=0"])
        assert result.exit_code == 0, result.output
    zipped, sharded = ImageFolderDataset(tmp_path / "latents16.zip"), ShardDataset(tmp_path / "latents16.shards")
    assert zipped.image_shape == sharded.image_shape == [32, 8, 8]  # mean and std of 16 channels, 2x downsampled
    assert all(torch.equal(torch.from_numpy(zipped[i][0]), torch.from_numpy(sharded[i][0])) for i in range(32))
    assert zipped.encoding_settings == sharded.encoding_settings == dict(
        vae_name=str(vae), latent_channels=16, raw_mean=0.06, raw_std=0.65, final_mean=0.0, final_std=0.5)

    result = train(tmp_path / "latents16.shards", tmp_path / "run", "--duration=64", "--batch=32", "--snapshot=64",
                   "--checkpoint=64", "--status=32")
    assert result.exit_code == 0, result.output
    snapshot = sorted((tmp_path / "run").glob("network-snapshot-*.safetensors"))[0]
    _, encoder, metadata = load_generator(snapshot)
    assert isinstance(encoder, DiffusersVAEEncoder) and metadata["encoder"]["latent_channels"] == 16
    assert metadata["network_kwargs"]["img_channels"] == 16  # the network sees the VAE's 16 latent channels
    out = tmp_path / "images"
    result = CliRunner().invoke(generate.main, [f"--net={snapshot}", f"--outdir={out}", "--seeds=0-1", "--steps=2"])
    assert result.exit_code == 0, result.output
    images = sorted(out.glob("*.png"))
    assert len(images) == 2 and ImageFolderDataset(out).image_shape == [3, 16, 16]  # decoded through the VAE
