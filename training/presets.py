"""Training presets: the release's ImageNet recipes (paper Table 6) and small CPU recipes, one row each."""

from __future__ import annotations

import dataclasses

import edm2.architectures  # noqa: F401  (every family a preset may name)
from edm2 import families
from edm2.errors import EDM2Error

Ki, Mi = 1 << 10, 1 << 20
# train_edm2.py --method: the paper's diffusion training, and consistency training and distillation (sCM, Lu and
# Song, ICLR 2025; edm2.consistency_loss).
DEFAULT_METHOD = "edm2"
TRAINING_METHODS = (DEFAULT_METHOD, "sct", "scd")


class PresetError(EDM2Error):
    """No preset has the name asked for, or a preset row gives what its network family does not take."""


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
    family: str = families.DEFAULT_FAMILY  # the network family (edm2.families)
    method: str = DEFAULT_METHOD  # one of TRAINING_METHODS
    tangent_warmup_Mimg: float = 0.0  # a consistency model's tangent warmup (sCM's Algorithm 1)
    adam_eps: float | None = None  # None: the release's (training.state.ADAM_EPS)
    # Some of the family's hyperparameters (NetworkFamily.hyperparameters), where the recipe differs from its defaults.
    hyperparameters: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        """Refuse a row whose hyperparameters are not its family's, or outside their bounds (PresetError)."""
        try:
            families.get(self.family).check(self.hyperparameters)
        except families.ArchitectureError as e:
            raise PresetError(f"a preset of the network family {self.family!r}: {e}") from None

    @property
    def network(self) -> dict:
        """The Precond arguments beyond the release's defaults: the hyperparameters, and the family unless it is the
        U-Net's (as a run's options record them)."""
        family = {} if self.family == families.DEFAULT_FAMILY else dict(family=self.family)
        return dict(self.hyperparameters, **family)


IMG512 = "datasets/img512-sd.zip"  # latents of the Stable Diffusion VAE, `dataset_tool.py encode`
IMG64 = "datasets/img64.zip"
TOY = "datasets/toy16.zip"
# The tests' and the demo's U-Nets: two or three levels, one block each, attention at the lowest.
TOY_TINY_UNET = dict(channel_mult=(1, 2), num_blocks=1, attn_resolutions=(4,), channels_per_head=16)
TOY_SMALL_UNET = dict(channel_mult=(1, 2, 2), num_blocks=1, attn_resolutions=(8,), channels_per_head=32)

# The release's presets: Table 6's columns (duration as the release counts it, 2^31 images = "2147.5 Mimg"),
# batch 2048 and the release's intervals from the Preset defaults. edm2-img512-xxs and edm2-img64-xs are
# the release's too, though not in Table 6.
PRESETS: dict[str, Preset] = {
    "edm2-img512-xxs": Preset(data=IMG512, duration=2048 * Mi, channels=64, dropout=0.00, lr=0.0170, decay=70000,
                              P_mean=-0.4, P_std=1.0),
    "edm2-img512-xs": Preset(data=IMG512, duration=2048 * Mi, channels=128, dropout=0.00, lr=0.0120, decay=70000,
                             P_mean=-0.4, P_std=1.0),
    "edm2-img512-s": Preset(data=IMG512, duration=2048 * Mi, channels=192, dropout=0.00, lr=0.0100, decay=70000,
                            P_mean=-0.4, P_std=1.0),
    "edm2-img512-m": Preset(data=IMG512, duration=2048 * Mi, channels=256, dropout=0.10, lr=0.0090, decay=70000,
                            P_mean=-0.4, P_std=1.0),
    "edm2-img512-l": Preset(data=IMG512, duration=1792 * Mi, channels=320, dropout=0.10, lr=0.0080, decay=70000,
                            P_mean=-0.4, P_std=1.0),
    "edm2-img512-xl": Preset(data=IMG512, duration=1280 * Mi, channels=384, dropout=0.10, lr=0.0070, decay=70000,
                             P_mean=-0.4, P_std=1.0),
    "edm2-img512-xxl": Preset(data=IMG512, duration=896 * Mi, channels=448, dropout=0.10, lr=0.0065, decay=70000,
                              P_mean=-0.4, P_std=1.0),
    "edm2-img64-xs": Preset(data=IMG64, duration=1024 * Mi, channels=128, dropout=0.00, lr=0.0120, decay=35000,
                            P_mean=-0.8, P_std=1.6),
    "edm2-img64-s": Preset(data=IMG64, duration=1024 * Mi, channels=192, dropout=0.00, lr=0.0100, decay=35000,
                           P_mean=-0.8, P_std=1.6),
    "edm2-img64-m": Preset(data=IMG64, duration=2048 * Mi, channels=256, dropout=0.10, lr=0.0090, decay=35000,
                           P_mean=-0.8, P_std=1.6),
    "edm2-img64-l": Preset(data=IMG64, duration=1024 * Mi, channels=320, dropout=0.10, lr=0.0080, decay=35000,
                           P_mean=-0.8, P_std=1.6),
    "edm2-img64-xl": Preset(data=IMG64, duration=640 * Mi, channels=384, dropout=0.10, lr=0.0070, decay=35000,
                            P_mean=-0.8, P_std=1.6),
    # Seconds on a CPU: the tests' recipe (8x8 or 16x16 RGB images) with img64's noise distribution; the
    # ramp-up and decay shrunk to the run length.
    "toy-tiny": Preset(data=TOY, duration=2 * Ki, channels=16, dropout=0.00, lr=0.0100, decay=100, P_mean=-0.8,
                       P_std=1.6, batch=32, rampup_Mimg=0.0005, status=256, snapshot=1 * Ki, checkpoint=1 * Ki,
                       hyperparameters=TOY_TINY_UNET),
    # About five minutes on a CPU core (~110 images/s): the quickstart demo on 16x16 shapes from
    # `dataset_tool.py toy --resolution=16`. lr 0.02 beat 0.01 in a 16Ki-image trial at this batch.
    "toy-small": Preset(data=TOY, duration=32 * Ki, channels=32, dropout=0.00, lr=0.0200, decay=200, P_mean=-0.8,
                        P_std=1.6, batch=64, rampup_Mimg=0.002, status=2 * Ki, snapshot=8 * Ki, checkpoint=16 * Ki,
                        hyperparameters=TOY_SMALL_UNET),
}

# The paper's Table 1 ladder (families config-b/c/d/e of edm2.architectures.ladder, config-f of
# edm2.architectures.config_f): CONFIG B to F at ImageNet-512 with the 192-channel U-Net of Table 1 (G is
# edm2-img512-s), attention at 16x16 and 8x8 (B's removal of 32x32), and ADM's 10% dropout, which only G could
# drop (Appendix B.7). B and C train at Adam rate 0.0002 (Appendix B.2), D raises it to 0.0100 for N(0,1) weights
# (Appendix B.4); all three constant (t_ref = infinity, decay 0); E adds Eq. 67's decay with t_ref 70000 (Appendix
# B.5), which F keeps. The toy rows scale toy-small's recipe by the same ratios (toy-small's 0.0200 is twice Table
# 1's 0.0100), each with toy-small's data, batch, length and dropout (none), so that the configurations compare
# by their defining changes alone.
LADDER_RATES = {"B": (0.0002, 0), "C": (0.0002, 0), "D": (0.0100, 0), "E": (0.0100, 70000), "F": (0.0100, 70000)}
LADDER_DROPOUT = 0.10
for _config, (_lr, _decay) in LADDER_RATES.items():
    PRESETS[f"config-{_config.lower()}-img512"] = dataclasses.replace(
        PRESETS["edm2-img512-s"], lr=_lr, decay=_decay, dropout=LADDER_DROPOUT, family=f"config-{_config.lower()}")
    PRESETS[f"config-{_config.lower()}-toy"] = dataclasses.replace(
        PRESETS["toy-small"], lr=2 * _lr, decay=_decay and PRESETS["toy-small"].decay,
        family=f"config-{_config.lower()}")
PRESETS["config-g-img512"] = PRESETS["edm2-img512-s"]
PRESETS["config-g-toy"] = PRESETS["toy-small"]

# Continuous-time consistency models (sCM, Lu and Song, ICLR 2025) of each EDM2 ImageNet-512 size, the student
# starting from its teacher's weights (train_edm2.py --teacher): the paper's Adam rate (the teacher's x 0.01), betas
# (0.9, 0.99, the release's), eps 1e-11, proposal P = (-0.8, 1.6) and batch 2048, and its tangent warmup over the first
# 10k iterations. The duration is ours (the paper gives none per size); decay and ramp-up are the teacher's.
SCM_LR_SCALE, SCM_ADAM_EPS, SCM_P_MEAN, SCM_P_STD = 0.01, 1e-11, -0.8, 1.6
SCM_WARMUP_ITERATIONS = 10000
SCM_DURATION = 128 * Mi
for _size in ("xxs", "xs", "s", "m", "l", "xl", "xxl"):
    _teacher = PRESETS[f"edm2-img512-{_size}"]
    for _method in ("sct", "scd"):
        PRESETS[f"{_method}-img512-{_size}"] = dataclasses.replace(
            _teacher, duration=SCM_DURATION, lr=_teacher.lr * SCM_LR_SCALE, P_mean=SCM_P_MEAN, P_std=SCM_P_STD,
            adam_eps=SCM_ADAM_EPS, method=_method,
            tangent_warmup_Mimg=SCM_WARMUP_ITERATIONS * _teacher.batch / 1e6)
# The toy students of toy-tiny and toy-small teachers (or toy sCT from scratch): the teacher's recipe at a tenth of
# its rate, with the tangent warmup over the first quarter of the run.
SCM_TOY_LR_SCALE = 0.1
for _name in ("toy-tiny", "toy-small"):
    _teacher = PRESETS[_name]
    for _method in ("sct", "scd"):
        PRESETS[f"{_method}-{_name}"] = dataclasses.replace(
            _teacher, lr=_teacher.lr * SCM_TOY_LR_SCALE, adam_eps=SCM_ADAM_EPS, method=_method,
            tangent_warmup_Mimg=_teacher.duration / 4 / 1e6)


def get_preset(name: str) -> Preset:
    """The preset called name; PresetError names the known ones."""
    if name not in PRESETS:
        raise PresetError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]
