"""Training options that check themselves: built in Python they are refused as train_edm2.py refuses them, with the
same message, and train() refuses data, a batch split or an --init snapshot that does not fit them before it writes
anything."""

import dataclasses
import math

import pytest
from click.testing import CliRunner

import train_edm2
from edm2.data.dataset import ImageFolderDataset
from edm2.encoders import StandardRGBEncoder
from edm2.formats.snapshot import save_network
from edm2.runtime import distributed
from training.architecture import NetworkMisfit, network_options, read_init
from training.options import OptionsError, TrainingOptions
from training.run.loop import train
from training.run.preflight import dataset_description
from training.presets import get_preset
from tests.helpers import (DATA_8X8, TRAIN_ARGS, assert_one_error_line, randomized, tiny_precond, toy_tiny_options,
                           tree, write_image_dataset)

# An --init U-Net unlike the toy-tiny preset's: eight channels, one level of two blocks, no attention resolutions.
INIT_UNET = dict(model_channels=8, channel_mult=(1,), num_blocks=2, attn_resolutions=(), channels_per_head=8)


def cli_error(*args) -> str:
    """The one error line train_edm2.py answers these options with (toy-tiny, see helpers.TRAIN_ARGS)."""
    return assert_one_error_line(CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, *map(str, args)]))


# (train_edm2.py options, the same as TrainingOptions values): U-Nets that 8x8 data cannot have (toy-tiny: levels 8
# and 4, 16 channels, heads of 16).
ARCHITECTURES = {
    "levels": (["--channel-mult=1,2,2,2,2"], dict(channel_mult=(1, 2, 2, 2, 2))),
    "attention resolution": (["--attn-resolutions=16"], dict(attn_resolutions=(16,))),
    "the preset's attention, other levels": (["--channel-mult=1"], dict(channel_mult=(1,))),
    "no head": (["--attn-resolutions=8", "--channels=8"], dict(attn_resolutions=(8,), channels=8)),
    "uneven heads": (["--channels=35"], dict(channels=35)),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("case", ARCHITECTURES)
def test_options_built_in_python_refuse_an_architecture_with_the_command_lines_message(case, train_data, tmp_path):
    args, values = ARCHITECTURES[case]
    line = cli_error(f"--data={train_data}", f"--outdir={tmp_path / 'run'}", *args)
    channels = values.pop("channels", None)
    network = network_options(get_preset("toy-tiny"), values)
    with pytest.raises(NetworkMisfit) as info:
        toy_tiny_options(channels=channels, network=network, run_dir=str(tmp_path / "run"), data=str(train_data))
    assert line == f"Error: {info.value}"
    assert tree(tmp_path) == []


def test_a_presets_attention_that_other_data_lacks_is_left_out_as_on_the_command_line():
    # toy-tiny's attention at 4x4 is no level of 16x16 data (16, 8): not asked for, so left out, not refused.
    opts = TrainingOptions.from_preset("toy-tiny", dict(DATA_8X8, resolution=16), {})
    assert opts.network == get_preset("toy-tiny").network


# field -> a value the options refuse, and the start of the message (the option as train_edm2.py spells it).
BAD_VALUES = {
    "precision": ("fp8", "--precision='fp8': expected one of fp32, fp16, bf16"),
    "duration": (0, "--duration=0: expected an image count from 1 to 2**53 - 1"),
    "batch": (True, "--batch=True: expected an integer from 1 to 1048576"),
    "batch_gpu": (-1, "--batch-gpu=-1: expected an integer from 0 to 1048576"),
    "snapshot": (-1, "--snapshot=-1: expected an image count from 0 to 2**53 - 1"),
    "lr": (0.0, "--lr=0.0: expected a number > 0"),
    "P_std": (math.nan, "--P_std=nan: expected a number > 0"),
    "rampup_Mimg": (-0.5, "--rampup=-0.5: expected a number >= 0"),
    "dropout": (1.0, "--dropout=1.0: expected a number in [0, 1)"),
    "ema_stds": ((), "--ema-stds=(): expected one or more sigma_rel in (0, 0.2887)"),
    "compile": ("yes", "--compile='yes': expected True, False or None"),
    "grid": ((0, 8), "--grid=(0, 8): expected (rows, cols) of 1 to 64 each, or () for none"),
    "loggers": (("mlflow",), "--logger=('mlflow',): expected a tuple of tensorboard, wandb"),
    "run_dir": ("", "--outdir='': expected a path"),
    "network": ([], "network=[]: expected an object"),
    "dataset": (dict(DATA_8X8, resolution="8"), "dataset={'label_dim': 4, 'num_channels': 3, 'resolution': '8'}: "
                                                "expected a resolution >= 1"),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("field", BAD_VALUES)
def test_options_refuse_a_value_that_cannot_work_naming_its_option(field):
    value, message = BAD_VALUES[field]
    valid = toy_tiny_options()
    with pytest.raises(OptionsError) as info:
        dataclasses.replace(valid, **{field: value})  # however they are built
    assert str(info.value) == message


@pytest.mark.bad_input
def test_label_dropout_without_labels_is_refused_as_the_command_line_refuses_it(train_data, tmp_path):
    line = cli_error(f"--data={train_data}", f"--outdir={tmp_path / 'run'}", "--cond=False", "--label-dropout=0.1")
    with pytest.raises(OptionsError) as info:
        toy_tiny_options(cond=False, label_dropout=0.1)
    assert line == f"Error: Invalid value for '--label-dropout': {info.value}"


def init_snapshot(path, **overrides):
    """Our snapshot of a random 8x8 RGB net of 4 classes with INIT_UNET (overrides replace its arguments)."""
    net = randomized(tiny_precond(**{**dict(img_resolution=8, img_channels=3, label_dim=4), **INIT_UNET, **overrides}))
    save_network(path, net, {"encoder": StandardRGBEncoder().config()})
    return path


def train_from_python(opts: TrainingOptions, dataset: ImageFolderDataset):
    """train() as a Python program calls it."""
    with distributed.session():
        return train(opts, dataset, StandardRGBEncoder())


@pytest.mark.bad_input
def test_train_refuses_an_init_of_another_architecture_with_the_command_lines_message(train_data, tmp_path):
    init = init_snapshot(tmp_path / "init.safetensors")
    line = cli_error(f"--data={train_data}", f"--outdir={tmp_path / 'run'}", f"--init={init}", "--channel-mult=1,2")
    snapshot = read_init(str(init))  # the snapshot's architecture, as a run from it takes it; but two levels
    opts = toy_tiny_options(init=snapshot.path, channels=snapshot.channels,
                       network=dict(snapshot.network, channel_mult=[1, 2]), run_dir=str(tmp_path / "run"),
                       data=str(train_data))
    with pytest.raises(NetworkMisfit) as info:
        train_from_python(opts, ImageFolderDataset(str(train_data)))
    assert line == f"Error: Invalid value for --init: {info.value}"
    assert tree(tmp_path) == ["init.safetensors"]  # no run directory


# id -> (changes to options that fit train_data and the --init snapshot, or a dataset to train on instead, and the
# start of the message): what only a run from Python can get wrong, refused by train() before it writes anything.
PREFLIGHT = {
    "other data": (dict(dataset=dict(DATA_8X8, resolution=16)), None,
                   "the options describe the data as {'resolution': 16, "),
    "other encoder": (dict(encoder={"class": "StabilityVAEEncoder"}), None, "the options' encoder is"),
    "batch over rounds": (dict(batch=16, batch_gpu=5), None,
                          "batch 16 is not divisible by 1 process(es) x batch-gpu 5"),
    "another U-Net": (dict(network=dict(INIT_UNET, label_balance=0.4)), None, "network={"),
    "labels not widened": ({}, "two classes", "init.safetensors is a network of 4 classes, but the data's labels are "
                                              "one-hot over 2"),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("case", PREFLIGHT)
def test_train_refuses_what_does_not_fit_its_options_before_writing(case, train_data, tmp_path):
    changes, other_data, message = PREFLIGHT[case]
    init = init_snapshot(tmp_path / "init.safetensors")
    snapshot = read_init(str(init))
    data = write_image_dataset(tmp_path / "two", num=8, classes=2) if other_data else train_data
    dataset = ImageFolderDataset(str(data))
    values = dict(init=snapshot.path, channels=snapshot.channels, network=snapshot.network, data=str(data),
                  dataset=dataset_description(dataset), encoder=StandardRGBEncoder().config(),
                  run_dir=str(tmp_path / "run"))
    before = tree(tmp_path)
    opts = TrainingOptions.from_preset("toy-tiny", **{**values, **changes})
    with pytest.raises((OptionsError, NetworkMisfit)) as info:
        train_from_python(opts, dataset)
    assert str(info.value).startswith(message)
    assert tree(tmp_path) == before

