"""The options of a training run, and the hyperparameters among them that a resumed run must keep."""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from edm2.errors import EDM2Error
from edm2.speed import PRECISIONS, channels_last_by_default, compile_by_default  # noqa: F401 (PRECISIONS: options)
from training.presets import get_preset
from training.sample_grid import DEFAULT_GRID, DEFAULT_GRID_STEPS

# Options that define the trained model; a resumed run must keep them. The others (data path,
# duration, intervals, batch_gpu, workers, run_dir, the speed options) may change between invocations: they affect
# where and for how long training runs and how much memory it uses, not what it computes.
HYPERPARAMETERS = (
    "preset", "cond", "batch", "channels", "dropout", "P_mean", "P_std", "lr", "decay", "rampup_Mimg",
    "ema_stds", "network", "precision", "ls", "seed", "dataset", "init", "label_dropout",
)
# Hyperparameters added after runs were made: the value a run whose options lack them trained with.
ADDED_HYPERPARAMETERS = {"label_dropout": 0.0}

# The fields that are no command-line option: dataset and encoder describe the data (read from it again), network
# holds the U-Net shape options and otherwise comes from the preset or --init.
DATA_FIELDS = ("dataset", "encoder")
RECIPE_FIELDS = ("network",)


class OptionsError(EDM2Error):
    """Options that cannot work together, e.g. a batch that does not split evenly over the processes."""


class OptionsMismatch(OptionsError):
    """Resuming with hyperparameters that differ from the run's."""


@dataclasses.dataclass(frozen=True)
class TrainingOptions:
    """Everything a run needs; image counts are in images, decay (t_ref of Eq. 67) in iterations."""

    preset: str
    dataset: dict  # resolution, num_channels, label_dim of the training data
    encoder: dict  # encoder.config()
    duration: int
    batch: int
    channels: int
    dropout: float
    P_mean: float
    P_std: float
    lr: float  # alpha_ref of Eq. 67
    decay: float
    rampup_Mimg: float
    ema_stds: tuple[float, ...]
    network: dict  # further Precond arguments of the preset
    status: int
    snapshot: int
    checkpoint: int
    run_dir: str
    data: str
    cond: bool = True
    batch_gpu: int = 0  # per rank and round; 0 = batch // world_size
    precision: str = "fp16"
    ls: float = 1.0
    seed: int = 0
    label_dropout: float = 0.0  # probability of training an image with the all-zero (unconditional) label
    workers: int = 2
    keep_states: int = 0  # training states kept on disk, the newest; 0 = all (where, not what: no hyperparameter)
    init: str | None = None  # the snapshot whose weights start the network and EMA tracks (path or URL)
    # How fast, not what: a resumed run may change these (edm2/speed.py). None: the device's default.
    compile: bool | None = None  # torch.compile of the network and the loss
    channels_last: bool | None = None  # NHWC convolution weights and activations
    checkpoint_activations: bool = False  # recompute each U-Net block's activations in the backward pass
    cpu_16bit: bool = False  # compute in `precision` on the CPU too (float32 there otherwise)
    ema_shard: bool = False  # where, not what: each rank keeps its 1/world of the EMA tracks (edm2.sharded_ema)
    # What rank 0 reports, not what is trained: trackers (training/trackers.py) and the snapshots' sample grids.
    loggers: tuple[str, ...] = ()
    grid: tuple[int, ...] = DEFAULT_GRID  # (rows, cols), () for none
    grid_steps: int = DEFAULT_GRID_STEPS

    @classmethod
    def from_preset(cls, preset: str, dataset: dict, encoder: dict, **overrides) -> TrainingOptions:
        """The preset's recipe for a dataset, with the overrides that are not None."""
        recipe = get_preset(preset)
        values = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe) if f.name in _FIELDS}
        values.update(run_dir=os.path.join("training-runs", preset), network=dict(recipe.network))
        values.update({k: v for k, v in overrides.items() if v is not None})
        # A preset's decay=100 and --decay=100 are one value: floats throughout, so the options print alike.
        values.update({k: float(values[k]) for k in _FLOAT_FIELDS if k in values})
        values["ema_stds"] = tuple(values["ema_stds"])  # --ema-stds gives a list
        return cls(preset=preset, dataset=dataset, encoder=encoder, **values)

    def to_json(self) -> dict:
        """The options as plain JSON values (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def compiles(self, device: torch.device) -> bool:
        """Whether the run compiles its network and loss on this device."""
        return compile_by_default(device) if self.compile is None else self.compile

    def uses_channels_last(self, device: torch.device) -> bool:
        """Whether the run keeps its convolutions channels-last on this device."""
        return channels_last_by_default(device) if self.channels_last is None else self.channels_last

    def hyperparameters(self) -> dict:
        """The options a resumed run must share with the original."""
        values = self.to_json()
        return {k: values[k] for k in HYPERPARAMETERS}


_FIELDS = {f.name for f in dataclasses.fields(TrainingOptions)}
_FLOAT_FIELDS = {f.name for f in dataclasses.fields(TrainingOptions) if f.type == "float"}


def rounds_per_step(batch: int, batch_gpu: int, world_size: int) -> tuple[int, int]:
    """(batch_gpu, rounds) for gradient accumulation; OptionsError unless batch = world * batch_gpu * rounds."""
    batch_gpu = batch_gpu or batch // world_size
    if batch_gpu < 1 or batch % (world_size * batch_gpu):
        raise OptionsError(
            f"batch {batch} is not divisible by {world_size} process(es) x batch-gpu {batch_gpu}"
        )
    return batch_gpu, batch // (world_size * batch_gpu)


def check_same_hyperparameters(stored: dict, current: dict) -> None:
    """Raise OptionsMismatch naming every hyperparameter whose value differs between the two runs' options."""
    stored = {**ADDED_HYPERPARAMETERS, **stored}
    differing = [k for k in HYPERPARAMETERS if stored.get(k) != current.get(k)]
    if differing:
        details = ", ".join(f"{k}: run has {stored.get(k)!r}, now {current.get(k)!r}" for k in differing)
        raise OptionsMismatch(f"cannot resume with different hyperparameters ({details})")


def check_derived(stored: dict, current: dict, option_keys: tuple[str, ...]) -> None:
    """Raise OptionsError naming each RECIPE_FIELDS value of stored options (a --config file) that the current options
    do not reproduce; the data's description is read again, and network's option_keys are options of their own."""
    def comparable(values: dict, key: str):
        value = values.get(key)
        return {k: v for k, v in value.items() if k not in option_keys} if key == "network" else value

    differing = [k for k in RECIPE_FIELDS if k in stored and comparable(stored, k) != comparable(current, k)]
    if differing:
        details = ", ".join(f"{k}: file has {comparable(stored, k)!r}, the preset or --init gives "
                            f"{comparable(current, k)!r}" for k in differing)
        raise OptionsError(f"values no option can set ({details})")
