"""Training presets: the release's ImageNet recipes (paper Table 6) and small CPU recipes."""

from __future__ import annotations

import dataclasses

Ki, Mi = 1 << 10, 1 << 20


@dataclasses.dataclass(frozen=True)
class Preset:
    """One training recipe; durations and intervals are counted in images."""

    data: str  # default dataset path
    duration: int
    channels: int  # model_channels
    dropout: float
    lr: float  # alpha_ref of Eq. 67
    decay: float  # t_ref of Eq. 67, in iterations
    P_mean: float
    P_std: float
    batch: int = 2048
    rampup_Mimg: float = 10  # linear learning-rate ramp-up (release)
    ema_stds: tuple[float, ...] = (0.050, 0.100)
    status: int = 128 * Ki
    snapshot: int = 8 * Mi
    checkpoint: int = 128 * Mi
    network: tuple[tuple[str, object], ...] = ()  # Precond arguments beyond the defaults


def _img512(duration: int, channels: int, dropout: float, lr: float) -> Preset:
    return Preset("datasets/img512-sd.zip", duration, channels, dropout, lr, 70000, -0.4, 1.0)


def _img64(duration: int, channels: int, dropout: float, lr: float) -> Preset:
    return Preset("datasets/img64.zip", duration, channels, dropout, lr, 35000, -0.8, 1.6)


def _toy(**kwargs) -> Preset:
    # RGB noise distribution of img64; tiny U-Net; the ramp-up and decay shrunk to the run length.
    network = (("channel_mult", (1, 2)), ("num_blocks", 1), ("attn_resolutions", (4,)), ("channels_per_head", 16))
    defaults = dict(data="datasets/toy16.zip", dropout=0.0, P_mean=-0.8, P_std=1.6, network=network)
    return Preset(**{**defaults, **kwargs})


PRESETS: dict[str, Preset] = {
    "edm2-img512-xs": _img512(2048 * Mi, 128, 0.00, 0.0120),
    "edm2-img512-s": _img512(2048 * Mi, 192, 0.00, 0.0100),
    "edm2-img512-m": _img512(2048 * Mi, 256, 0.10, 0.0090),
    "edm2-img512-l": _img512(1792 * Mi, 320, 0.10, 0.0080),
    "edm2-img512-xl": _img512(1280 * Mi, 384, 0.10, 0.0070),
    "edm2-img512-xxl": _img512(896 * Mi, 448, 0.10, 0.0065),
    "edm2-img64-xs": _img64(1024 * Mi, 128, 0.00, 0.0120),
    "edm2-img64-s": _img64(1024 * Mi, 192, 0.00, 0.0100),
    "edm2-img64-m": _img64(2048 * Mi, 256, 0.10, 0.0090),
    "edm2-img64-l": _img64(1024 * Mi, 320, 0.10, 0.0080),
    "edm2-img64-xl": _img64(640 * Mi, 384, 0.10, 0.0070),
    # Seconds on a CPU: the tests' recipe (8x8 or 16x16 images).
    "toy-tiny": _toy(
        duration=2 * Ki, batch=32, channels=16, lr=0.0100, decay=100, rampup_Mimg=0.0005,
        status=256, snapshot=1 * Ki, checkpoint=1 * Ki,
    ),
    # About five minutes on a CPU core (~110 images/s): the quickstart demo on 16x16 shapes from
    # `dataset_tool.py toy --resolution=16`. lr 0.02 beat 0.01 in a 16Ki-image trial at this batch.
    "toy-small": _toy(
        duration=32 * Ki, batch=64, channels=32, lr=0.0200, decay=200, rampup_Mimg=0.002,
        status=2 * Ki, snapshot=8 * Ki, checkpoint=16 * Ki,
        network=(("channel_mult", (1, 2, 2)), ("num_blocks", 1), ("attn_resolutions", (8,)), ("channels_per_head", 32)),
    ),
}


def get_preset(name: str) -> Preset:
    """The preset called name; KeyError names the known ones."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]
