"""Release presets against paper Table 6 and the release's durations, intervals and checkpoints."""

import dataclasses

import pytest
import torch

from edm2 import families
from edm2.networks import count_parameters
from training.options import TrainingOptions
from training.presets import PRESETS, PresetError, get_preset
from training.state import init_network
from tests.helpers import IMG64_UNET_PARAMS, IMG512_PARAMS, SIZES

Mi = 2**20

# The release's training durations in images (its training/presets), by dataset and size.
DURATIONS = {
    "img512": {"xs": 2048 * Mi, "s": 2048 * Mi, "m": 2048 * Mi, "l": 1792 * Mi, "xl": 1280 * Mi, "xxl": 896 * Mi},
    "img64": {"xs": 1024 * Mi, "s": 1024 * Mi, "m": 2048 * Mi, "l": 1024 * Mi, "xl": 640 * Mi},
}
# Paper Table 6, "Duration (Mimg)" (millions of images, rounded to 0.1); Table 6 has no img64-xs.
TABLE6_MIMG = {
    "img512": {"xs": 2147.5, "s": 2147.5, "m": 2147.5, "l": 1879.0, "xl": 1342.2, "xxl": 939.5},
    "img64": {"s": 1073.7, "m": 2147.5, "l": 1073.7, "xl": 671.1},
}
NOISE_AND_DECAY = {"img512": (-0.4, 1.0, 70000), "img64": (-0.8, 1.6, 35000)}
RELEASE = [(res, size) for res, sizes in DURATIONS.items() for size in sizes]


def test_every_release_preset_exists():
    assert {f"edm2-{res}-{size}" for res, size in RELEASE} <= set(PRESETS)
    assert len(RELEASE) == 11


@pytest.mark.parametrize("res, size", RELEASE)
def test_release_preset_values(res, size):
    p = get_preset(f"edm2-{res}-{size}")
    channels, dropout, lr = SIZES[size]
    P_mean, P_std, decay = NOISE_AND_DECAY[res]
    assert (p.channels, p.dropout, p.lr) == (channels, dropout, lr)
    assert (p.P_mean, p.P_std, p.decay) == (P_mean, P_std, decay)
    assert p.duration == DURATIONS[res][size]
    if size in TABLE6_MIMG[res]:
        assert round(p.duration / 1e6, 1) == TABLE6_MIMG[res][size]
    assert p.batch == 2048 and p.rampup_Mimg == 10 and p.ema_stds == (0.050, 0.100)
    assert (p.status, p.snapshot, p.checkpoint) == (128 * 2**10, 8 * Mi, 128 * Mi)
    assert p.network == {}  # the release's architecture defaults
    assert p.data == ("datasets/img512-sd.zip" if res == "img512" else "datasets/img64.zip")


def test_xxs_is_the_release_training_preset():
    # Not in Table 6: the release's train_edm2.py adds edm2-img512-xxs, half of XS's width with a higher
    # alpha_ref, trained like the other img512 presets.
    p = get_preset("edm2-img512-xxs")
    assert (p.channels, p.dropout, p.lr, p.duration) == (64, 0.00, 0.0170, 2048 * Mi)
    assert (p.P_mean, p.P_std, p.decay) == NOISE_AND_DECAY["img512"] and p.data == get_preset("edm2-img512-xs").data
    assert p.batch == 2048 and p.rampup_Mimg == 10 and p.ema_stds == (0.050, 0.100) and p.network == {}
    assert (p.status, p.snapshot, p.checkpoint) == (128 * 2**10, 8 * Mi, 128 * Mi)
    opts = TrainingOptions.from_preset("edm2-img512-xxs", dataset=dict(resolution=64, num_channels=8, label_dim=1000),
                                       encoder={})
    with torch.device("meta"):
        net = init_network(opts, img_channels=4)
    # Convolutions and attention grow with the square of the width, the class embedding linearly: a bit
    # over a quarter of XS's parameters.
    assert net.init_kwargs["model_channels"] == 64
    assert 0.25 < count_parameters(net) / IMG512_PARAMS["xs"] < 0.26


# The img64 counts gain the 128 weights of the log-variance head.
PARAMS = {**{("img512", size): n for size, n in IMG512_PARAMS.items()},
          **{("img64", size): n + 128 for size, n in IMG64_UNET_PARAMS.items()}}


@pytest.mark.parametrize("res, size", [("img512", "xs"), ("img512", "xxl"), ("img64", "s"), ("img64", "xl")])
def test_preset_builds_the_release_network(res, size):
    num_channels = 8 if res == "img512" else 3  # stored latents hold mean and std
    opts = TrainingOptions.from_preset(
        f"edm2-{res}-{size}", dataset=dict(resolution=64, num_channels=num_channels, label_dim=1000), encoder={}
    )
    with torch.device("meta"):
        net = init_network(opts, img_channels=4 if res == "img512" else 3)
    assert count_parameters(net) == PARAMS[(res, size)]
    assert net.init_kwargs["dropout"] == SIZES[size][1] and net.init_kwargs["use_fp16"]


def test_toy_presets_are_small_and_consistent():
    for name in ("toy-tiny", "toy-small"):
        p = get_preset(name)
        assert p.duration % p.batch == 0 and p.snapshot % p.batch == 0 and p.checkpoint % p.batch == 0
        assert p.duration <= 64 * 2**10 and p.channels <= 32 and p.rampup_Mimg * 1e6 < p.duration


def test_overrides_and_unknown_preset():
    opts = TrainingOptions.from_preset(
        "toy-tiny", dataset={}, encoder={}, lr=0.5, batch=None, run_dir=None, seed=7
    )
    assert opts.lr == 0.5 and opts.batch == get_preset("toy-tiny").batch and opts.seed == 7
    assert opts.run_dir == "training-runs/toy-tiny"
    with pytest.raises(PresetError, match="unknown preset 'nope'"):
        get_preset("nope")


@pytest.mark.parametrize("precision, fp16, bf16", [("fp16", True, False), ("bf16", False, True), ("fp32", False, False)])
def test_precision_selects_the_unet_dtype(precision, fp16, bf16):
    opts = TrainingOptions.from_preset("toy-tiny", dataset=dict(resolution=8, num_channels=3, label_dim=4),
                                       encoder={}, precision=precision)
    net = init_network(opts, img_channels=3)
    assert (net.use_fp16, net.use_bf16) == (fp16, bf16)
    # FP32 master weights; 16-bit activations only on CUDA (the CPU computes in float32 whatever is chosen).
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert net.compute_dtype(torch.device("cpu")) == torch.float32
    want = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    assert net.compute_dtype(torch.device("cuda", 0)) == want


def test_a_preset_names_its_family_and_gives_only_that_familys_hyperparameters():
    for name, p in PRESETS.items():
        family = families.get(p.family)
        assert set(p.hyperparameters) <= set(family.fields()), name
        assert p.network == (dict(p.hyperparameters) if p.family == "edm2" else dict(p.hyperparameters,
                                                                                    family=p.family))
    assert get_preset("config-e-toy").family == "config-e" and get_preset("toy-tiny").family == "edm2"
    toy = get_preset("toy-tiny")
    with pytest.raises(PresetError, match="^a preset of the network family 'mp-resnet': unknown network argument "
                                          "'channel_mult': the hyperparameters are depth$"):
        dataclasses.replace(toy, family="mp-resnet")
    with pytest.raises(PresetError, match="^a preset of the network family 'edm2': num_blocks=0: expected an integer "
                                          "from 1 to 64$"):
        dataclasses.replace(toy, hyperparameters=dict(num_blocks=0))
    with pytest.raises(PresetError, match="unknown network family 'dit'"):
        dataclasses.replace(toy, family="dit", hyperparameters={})
    assert dataclasses.replace(toy, family="mp-resnet", hyperparameters=dict(depth=2)).network == dict(
        depth=2, family="mp-resnet")
