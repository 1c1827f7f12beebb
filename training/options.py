"""The options of a training run in their sections, and the hyperparameters among them that a resumed run must keep:
the recipe and the network."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch

from edm2 import families
from edm2.errors import EDM2Error
from edm2.eval.scores import METRICS
from edm2.eval.validation import OWN, VALIDATION_LOSSES, fixed_losses_text
from edm2.families import DEFAULT_FAMILY
from edm2.loss import (DEFAULT_NOISE, DEFAULT_UNCERTAINTY, DEFAULT_WEIGHTING, NOISE_DISTRIBUTIONS, UNCERTAINTIES,
                       WEIGHTINGS)
from edm2.network_args import MAX_CHANNELS, shown
from edm2.phema import MAX_STD
from edm2.procedures.generation import MAX_SEED
from edm2.runtime.limits import MAX_BATCH, MAX_DEFAULT_PROCESSES, MAX_IMAGES, MAX_PROCESSES, MAX_THREADS, MAX_WORKERS
from edm2.runtime.speed import PRECISIONS, channels_last_by_default, compile_by_default
from training.architecture import check_network_fits_data, differs_from_preset, option_name
from training.presets import DEFAULT_METHOD, PRESETS, TRAINING_METHODS, get_preset
from training.sections import (FROM_PRESET, NAMES, NETWORK, PAIR, PATHS, RECIPE, REPEATED, REPORTING, SECTIONS,
                               SIGMA_RELS, SPEED, SWITCH, Count, Flag, GridShape, Images, Real, bounds, flag_name,
                               option, out_of_bounds, section_fields)
from training.text_conditioning import TEXT_OPTIONS

TRACKERS = ("tensorboard", "wandb")  # train_edm2.py --logger (training/run/trackers.py)
TRAINING_METRICS = (*METRICS, "loss")  # train_edm2.py --metrics: those of calculate_metrics.py, and the validation loss
DEFAULT_GRID = (4, 8)  # rows x columns of each snapshot's sample grid
MAX_DEFAULT_GRID_ROWS = 16  # the default grid gives every class a row up to this many classes
MAX_GRID_SIDE = 64  # rows or columns of a sample grid
DEFAULT_GRID_STEPS = 8  # sampler steps: a preview at under 2% of toy-small's training time (scripts/bench_track.py)
MAX_GRID_STEPS = 1000  # a bound on --grid-steps: more would make every snapshot a long wait
MAX_KEPT_STATES = 10**6  # training states to keep: far beyond any run's count of them
DEFAULT_METRICS_NUM = 2000  # images per metric while training (k-diffusion's 2,000; the paper's 50,000 come after)

# Hyperparameters added after runs were made: the value a run whose options lack them trained with.
# A run written before text dropout trained no text network: the default text dropout is what it had.
ADDED_HYPERPARAMETERS = {"label_dropout": 0.0, "text_dropout": 0.1, "loss_weighting": DEFAULT_WEIGHTING,
                         "noise_dist": DEFAULT_NOISE, "uncertainty": DEFAULT_UNCERTAINTY, "method": DEFAULT_METHOD,
                         "teacher": None, "tangent_warmup_Mimg": 0.0, "adam_eps": None}

# Eq. 16 draws ln(sigma) = P_mean + P_std * z. torch's normal draws come from uniforms of at most 53 bits, so
# |z| <= sqrt(-2 ln 2**-53) ~ 8.57 (Box-Muller); within |ln(sigma)| <= 40, sigma**2 and the (sigma * sigma_data)**2
# of Eq. 15's lambda stay normal float32 numbers (float32's normal range is e**-87.3 to e**88.7), and so do the
# dashboard's noise levels (P_mean +- 2.5 P_std).
MAX_NORMAL_DRAW = math.sqrt(-2 * math.log(2.0**-53))
MAX_LN_SIGMA = 40.0

# The fields that are no command-line option: dataset and encoder describe the data (read from it again), network
# holds the U-Net shape options and otherwise comes from the preset or --init.
DATA_FIELDS = ("dataset", "encoder")
RECIPE_FIELDS = ("network",)


def default_grid(label_dim: int) -> tuple[int, int]:
    """--grid's default for a network of label_dim classes (0: unconditional): DEFAULT_GRID, or, for more classes
    than its rows, one row per class (at most MAX_DEFAULT_GRID_ROWS) with about DEFAULT_GRID's image count (at
    least 4 columns)."""
    rows, cols = DEFAULT_GRID
    if label_dim <= rows:
        return DEFAULT_GRID
    return min(label_dim, MAX_DEFAULT_GRID_ROWS), max(rows * cols // min(label_dim, MAX_DEFAULT_GRID_ROWS), 4)


class OptionsError(EDM2Error):
    """Options that cannot work together, e.g. a batch that does not split evenly over the processes."""


class OptionsMismatch(OptionsError):
    """Resuming with hyperparameters that differ from the run's."""


@dataclasses.dataclass(frozen=True)
class TrainingOptions:
    """Everything a run needs; image counts are in images, decay (t_ref of Eq. 67) in iterations.

    Each field names its section, the bound of its values and, where the command line sets it, its flag
    (training.sections.option: train_edm2.py's options are made from them, cli.training_options). The options check
    themselves when built (__post_init__), section by section: each field against its bound and its flag's
    choices, then the section's rules across fields. So options built in Python are refused as the command line
    refuses them, with the same message where the command line has the check; what needs the data itself or the
    --init snapshot, training.run.preflight checks when training starts. The fields stay flat: they are
    training_options.json's keys.
    """

    preset: str = option(RECIPE, flag=Flag("Training recipe", choices=PRESETS, required=True))
    dataset: dict = option(NETWORK)  # resolution, num_channels, label_dim of the training data
    encoder: dict = option(PATHS)  # encoder.config(): read from the data again, as its path is
    duration: int = option(REPORTING, Images(1), flag=Flag("Training duration in images", default=FROM_PRESET))
    batch: int = option(RECIPE, Count(1, MAX_BATCH), flag=Flag("Total batch size", default=FROM_PRESET))
    channels: int = option(NETWORK, Count(1, MAX_CHANNELS))  # train_edm2.py's --channels, beside --arch
    dropout: float = option(RECIPE, Real(0, 1, high_open=True), flag=Flag("Dropout probability", default=FROM_PRESET))
    P_mean: float = option(RECIPE, Real(), flag=Flag("Noise level mean", name="P_mean", default=FROM_PRESET))
    P_std: float = option(RECIPE, Real(0, low_open=True),
                          flag=Flag("Noise level std", name="P_std", default=FROM_PRESET))
    lr: float = option(RECIPE, Real(0, low_open=True), flag=Flag("Learning rate alpha_ref", default=FROM_PRESET))
    decay: float = option(RECIPE, Real(0), flag=Flag("Learning rate decay t_ref in iterations, 0 = none",
                                                     default=FROM_PRESET))  # t_ref of Eq. 67
    rampup_Mimg: float = option(RECIPE, Real(0), flag=Flag("Learning rate ramp-up in millions of images, 0 = none",
                                                           name="rampup", default=FROM_PRESET))
    ema_stds: tuple[float, ...] = option(RECIPE, flag=Flag(
        "EMA lengths sigma_rel to track, one snapshot each, e.g. 0.05,0.1", form=SIGMA_RELS, default=FROM_PRESET))
    network: dict = option(NETWORK)  # further Precond arguments of the preset
    status: int = option(REPORTING, Images(0), flag=Flag("Status line interval, 0 = none", default=FROM_PRESET))
    snapshot: int = option(REPORTING, Images(0), flag=Flag("Snapshot interval, 0 = only at the end",
                                                           default=FROM_PRESET))
    checkpoint: int = option(REPORTING, Images(0), flag=Flag("Training-state interval, 0 = only at the end",
                                                             default=FROM_PRESET))
    run_dir: str = option(PATHS, flag=Flag("Run directory", name="outdir", metavar="DIR",
                                           default="training-runs/<preset>"))
    data: str = option(PATHS, flag=Flag(
        "Dataset: ZIP or folder, shard folder, or a blend PATH:WEIGHT,PATH:WEIGHT (or a .json spec)",
        metavar="ZIP|DIR|SHARDS|BLEND", default="the preset's, e.g. datasets/img512-sd.zip"))
    cond: bool = option(NETWORK, default=True, flag=Flag("Train a class-conditional model"))
    batch_gpu: int = option(SPEED, Count(0, MAX_BATCH), default=0, flag=Flag(
        "Images per GPU and round, 0 = batch / GPUs; smaller values accumulate gradients"))  # per rank and round
    precision: str = option(RECIPE, default="fp16", flag=Flag(
        "U-Net activations on CUDA (on the CPU float32 unless --cpu-16bit)", choices=PRECISIONS))
    ls: float = option(RECIPE, Real(0, low_open=True), default=1.0, flag=Flag("Loss scaling"))
    seed: int = option(RECIPE, Count(0, MAX_SEED - 1), default=0, flag=Flag("Random seed"))
    label_dropout: float = option(RECIPE, Real(0, 1, high_open=True), default=0.0, flag=Flag(
        "Probability of training an image with the all-zero label, so that the network can guide itself "
        "(generate.py --gnet=self); needs --cond=True"))
    text_dropout: float = option(RECIPE, Real(0, 1, high_open=True), default=0.1, flag=Flag(
        "Probability of training an image with the empty caption's text embedding, so that a text network can guide "
        "itself (data with text embeddings only)"))
    loss_weighting: str = option(RECIPE, default=DEFAULT_WEIGHTING, flag=Flag(
        "Loss weighting lambda(sigma) (edm2.loss.WEIGHTINGS; edm2: Eq. 15); snapshots record it", choices=WEIGHTINGS))
    noise_dist: str = option(RECIPE, default=DEFAULT_NOISE, flag=Flag(
        "Training noise distribution (edm2.loss.NOISE_DISTRIBUTIONS), placed by --P_mean and --P_std",
        choices=NOISE_DISTRIBUTIONS))  # Eq. 16
    uncertainty: str = option(RECIPE, default=DEFAULT_UNCERTAINTY, flag=Flag(
        "u(sigma) (edm2.loss.UNCERTAINTIES): learned (Eq. 21) absorbs any --loss-weighting; off trains lambda L",
        choices=UNCERTAINTIES))
    # What is trained: a diffusion model (the paper's), or a consistency model (edm2.consistency_loss) trained from
    # scratch (sct, or from --teacher's weights) or distilled from --teacher (scd), which the student starts from.
    method: str = option(RECIPE, default=DEFAULT_METHOD, flag=Flag(
        "Training method: edm2 (the paper's diffusion loss), sct (consistency training) or scd (consistency "
        "distillation of --teacher); snapshots record it", choices=TRAINING_METHODS, default=FROM_PRESET))
    teacher: str | None = option(RECIPE, default=None, flag=Flag(
        "With --method=sct or scd: the diffusion snapshot (ours, a post-hoc reconstruction or a release pickle) whose "
        "weights and network the student starts from, and whose ODE scd distils", metavar="SNAPSHOT|PKL|URL"))
    tangent_warmup_Mimg: float = option(RECIPE, Real(0), default=0.0, flag=Flag(
        "Consistency tangent warmup in millions of images (r = min(1, images / warmup)), 0 = none",
        name="tangent-warmup", default=FROM_PRESET))
    adam_eps: float | None = option(RECIPE, Real(0, low_open=True), optional=True, default=None, flag=Flag(
        "Adam's epsilon", default="the preset's, else the release's 1e-8"))
    workers: int = option(SPEED, Count(0, MAX_WORKERS), default=2, flag=Flag("Data loader processes per GPU"))
    # Whether a resume may go on where the data is not what its training state records (training.data_record).
    allow_data_change: bool = option(REPORTING, default=False, flag=Flag(
        "Resume even where the data is not what the newest training state records (its count, contents, a blend's "
        "shares): the change is said and logged, and the order of the data from there is not the uninterrupted "
        "run's", form=SWITCH))
    # Where, not what: no hyperparameter.
    keep_states: int = option(REPORTING, Count(0, MAX_KEPT_STATES), default=0, flag=Flag(
        "Keep this many newest training states, deleting older ones once a newer one reads back whole; 0 = all"))
    init: str | None = option(RECIPE, default=None, flag=Flag(
        "Start a new run from this snapshot's weights (ours or a release pickle); its architecture and encoder are "
        "taken, Adam starts afresh", metavar="SNAPSHOT|PKL|URL"))
    # How fast, not what: a resumed run may change these (edm2/runtime/speed.py). None: the device's default.
    compile: bool | None = option(SPEED, default=None, flag=Flag(
        "torch.compile the network and loss", form=PAIR, default="on CUDA only"))
    channels_last: bool | None = option(SPEED, default=None, flag=Flag(
        "Channels-last (NHWC) convolutions", form=PAIR, default="on CUDA only"))
    checkpoint_activations: bool = option(SPEED, default=False, flag=Flag(
        "Recompute each U-Net block's activations in the backward pass: less memory, ~1/3 more compute", form=SWITCH))
    cpu_16bit: bool = option(SPEED, default=False, flag=Flag(
        "Compute in --precision on the CPU too (use bf16), not float32", form=SWITCH))
    # --threads (cli.speed, shared by the command lines): PyTorch's CPU threads per process; None: PyTorch's default.
    threads: int | None = option(SPEED, Count(1, MAX_THREADS), optional=True, default=None)
    # Ranks train_edm2.py starts itself (cli.local_launch); None: its default. Under torchrun, torchrun's.
    processes: int | None = option(SPEED, Count(1, MAX_PROCESSES), optional=True, default=None, flag=Flag(
        "Processes this command starts on this machine, one model trained by all (as torchrun --standalone "
        "--nproc_per_node would; on CUDA one per GPU): on a CPU they hold up beside other work far better than one "
        "process of many threads. Ignored under torchrun", envvar="EDM2_PROCESSES",
        default=f"on a CPU one per core, up to {MAX_DEFAULT_PROCESSES}; on CUDA 1; $EDM2_PROCESSES"))
    # Where, not what: each rank keeps its 1/world of the EMA tracks (edm2.runtime.sharded_ema).
    ema_shard: bool = option(SPEED, default=False, flag=Flag(
        "Under torchrun, each process keeps only its 1/N of every EMA track, gathered on rank 0 to write snapshots "
        "and training states (the same files); with one process it changes nothing", form=SWITCH))
    # What rank 0 reports, not what is trained: trackers (training/run/trackers.py) and the snapshots' sample grids.
    loggers: tuple[str, ...] = option(REPORTING, default=(), flag=Flag(
        "Log to this experiment tracker too (repeatable; needs the package extra of its name)", name="logger",
        choices=TRACKERS, form=REPEATED, default="none"))
    grid: tuple[int, ...] = option(REPORTING, GridShape(1, MAX_GRID_SIDE), default=DEFAULT_GRID, flag=Flag(
        "Sample grid at every snapshot, RUN/samples/grid-KIMG.png (row r: class r); 0 = none",
        default=f"{'x'.join(map(str, DEFAULT_GRID))}, or a row per class up to {MAX_DEFAULT_GRID_ROWS} classes"))
    grid_steps: int = option(REPORTING, Count(1, MAX_GRID_STEPS), default=DEFAULT_GRID_STEPS,
                             flag=Flag("Sampler steps of the sample grid"))
    # Metrics of the snapshots while training (training/run/metrics.py).
    metrics: tuple[str, ...] = option(REPORTING, default=(), flag=Flag(
        "Measure the snapshots while training: calculate_metrics.py's metrics (fid, fd_dinov2, kid, precision, ...) "
        "and loss (the validation loss), logged as e.g. fid2k", metavar="LIST", choices=TRAINING_METRICS, form=NAMES,
        noun="metric", default="none"))
    metrics_every: int = option(REPORTING, Images(0), default=0, flag=Flag(
        "Metrics interval in images, a multiple of --snapshot; 0 = at every snapshot"))
    metrics_num: int = option(REPORTING, Count(2, MAX_IMAGES), default=DEFAULT_METRICS_NUM, flag=Flag(
        "Images generated (seeds 0..N-1), or loss samples, per metric"))
    metrics_ref: str | None = option(REPORTING, default=None, flag=Flag(
        "Reference statistics for the metrics of images (calculate_metrics.py ref); detectors from "
        "$EDM2_CACHE_DIR/detectors/", metavar="NPZ|PKL|URL"))
    # What the loss metric and the dashboard's loss per noise level measure (edm2.eval.validation.VALIDATION_LOSSES).
    validation_loss: str = option(REPORTING, default=OWN, flag=Flag(
        "The validation loss of --metrics=loss and of the dashboard's loss per noise level: 'own', the run's own "
        "weighting and noise distribution, or a fixed one that compares runs trained with other losses "
        f"({fixed_losses_text()})", choices=VALIDATION_LOSSES))
    # A post-hoc sigma_rel (Eq. 129) reconstructed from the run's snapshots; None: the first track.
    metrics_ema: float | None = option(REPORTING, Real(0, MAX_STD, low_open=True, high_open=True), optional=True,
                                       default=None, flag=Flag(
        "Measure the post-hoc EMA of this length, reconstructed from the run's snapshots so far (as "
        "reconstruct_phema.py does)", metavar="SIGMA_REL", default="the first --ema-stds track, as stored"))
    # None: the device's (edm2.runtime.utilization).
    peak_tflops: float | None = option(REPORTING, Real(0, 1e6, low_open=True), optional=True, default=None, flag=Flag(
        "One process's peak TFLOP/s for the MFU in the status lines",
        default="a listed GPU's data sheet; on a CPU its matmul peak, measured once and cached"))

    def __post_init__(self) -> None:
        """Refuse options that cannot work (OptionsError, NetworkMisfit), section by section: the bounds of its
        fields, then its rules."""
        for section in SECTIONS:
            refused = out_of_bounds(self, section)
            if refused is not None:
                name, expected = refused
                raise _refuse(name, getattr(self, name), expected)
            _RULES[section](self)

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
# The options that define the trained model, the recipe and the network: a resumed run must keep them. The others
# (the speed, reporting and paths sections) may change between invocations: they affect where and for how long
# training runs and how much memory it uses, not what it computes.
HYPERPARAMETERS = (*section_fields(TrainingOptions, RECIPE), *section_fields(TrainingOptions, NETWORK))
# The bound of each bounded field: the options check it, and train_edm2.py's option types are made from it.
BOUNDS = bounds(TrainingOptions)
_FLOAT_FIELDS = {f.name for f in dataclasses.fields(TrainingOptions) if f.type == "float"}


# Each field's option as the command line spells it.
_FLAG_NAMES = {f.name: flag_name(f) for f in dataclasses.fields(TrainingOptions)}


def _refuse(field: str, value: object, expected: str) -> OptionsError:
    """OptionsError naming the field's option as the command line spells it (the field, where no option sets it)."""
    name = field if field in (*DATA_FIELDS, *RECIPE_FIELDS) else f"--{_FLAG_NAMES[field]}"
    return OptionsError(f"{name}={shown(value)}: expected {expected}")


def _require(ok: bool, field: str, value: object, expected: str) -> None:
    """Raise _refuse(...) unless ok."""
    if not ok:
        raise _refuse(field, value, expected)


def check_label_dropout(label_dropout: float, cond: bool) -> None:
    """Raise OptionsError if a run without labels (cond False) would drop them."""
    if label_dropout and not cond:
        raise OptionsError("label dropout needs a class-conditional run (--cond=True): an unconditional network has "
                           "no label to drop")


def _check_recipe(opts: TrainingOptions) -> None:
    """What is trained, beyond its fields' bounds and choices: the noise levels, the EMA lengths, the --init
    snapshot."""
    check_noise_levels(opts.P_mean, opts.P_std)
    ema_std = Real(0, MAX_STD, low_open=True, high_open=True)
    _require(isinstance(opts.ema_stds, tuple) and len(opts.ema_stds) > 0 and all(map(ema_std.admits, opts.ema_stds)),
             "ema_stds", opts.ema_stds, f"one or more sigma_rel in (0, {MAX_STD:.4f})")
    _require(opts.init is None or isinstance(opts.init, str) and opts.init != "", "init", opts.init, "a path")
    check_method(opts.method, opts.teacher)
    _require(opts.teacher is None or opts.init == opts.teacher, "init", opts.init,
             f"--teacher's {opts.teacher!r}: a student starts from its teacher's weights")


def check_method(method: str, teacher: str | None, init: str | None = None) -> None:
    """Raise OptionsError unless the method and its teacher go together: scd distils a teacher, edm2 takes none, and
    a student starts from its teacher's weights, so an --init other than the teacher (a run's own options name it
    as both) is refused."""
    if method == "scd" and teacher is None:
        raise OptionsError("--method=scd distils a teacher: give --teacher=SNAPSHOT")
    if method == DEFAULT_METHOD and teacher is not None:
        raise OptionsError("--teacher is for --method=sct or scd; --method=edm2 trains a diffusion model (--init "
                           "starts it from a snapshot's weights)")
    if teacher is not None and init not in (None, teacher):
        raise OptionsError("--init with --teacher: the student starts from the teacher's weights; leave --init out")


def check_noise_levels(P_mean: float, P_std: float) -> None:
    """Raise OptionsError when Eq. 16's noise levels can leave float32's range: |P_mean| + 8.57 P_std > 40
    (MAX_NORMAL_DRAW, MAX_LN_SIGMA)."""
    reach = abs(P_mean) + MAX_NORMAL_DRAW * P_std
    if not reach <= MAX_LN_SIGMA:
        raise OptionsError(f"--P_mean={shown(P_mean)} with --P_std={shown(P_std)}: |ln(sigma)| = |P_mean + P_std * z| "
                           f"reaches {reach:.4g} for the largest normal draws |z| = {MAX_NORMAL_DRAW:.2f}; it must "
                           f"stay within +-{MAX_LN_SIGMA:g}, where sigma**2 is a normal float32 number "
                           f"(|P_mean| + {MAX_NORMAL_DRAW:.2f} * P_std <= {MAX_LN_SIGMA:g})")


def _check_network(opts: TrainingOptions) -> None:
    """The network trained: labels (label dropout needs them), the U-Net's width and shape against the data's
    resolution, as train_edm2.py checks them; with --init the snapshot's architecture is checked against the data
    when training starts (training.run.preflight)."""
    _require(type(opts.cond) is bool, "cond", opts.cond, "True or False")
    check_label_dropout(opts.label_dropout, opts.cond)
    _require(isinstance(opts.dataset, dict), "dataset", opts.dataset, "an object")
    _require(isinstance(opts.network, dict), "network", opts.network, "an object")
    # Options that are only compared (hyperparameters) may leave out the data; preflight refuses such options.
    if "resolution" not in opts.dataset:
        return
    resolution = opts.dataset["resolution"]
    _require(type(resolution) is int and resolution >= 1, "dataset", opts.dataset, "a resolution >= 1")
    family = opts.network.get("family", DEFAULT_FAMILY)
    _require(family in families.names(), "network", opts.network, f"a network family of {', '.join(families.names())}")
    if opts.init is None and family == DEFAULT_FAMILY:
        check_network_fits_data(resolution, opts.channels, opts.network,
                                explicit=differs_from_preset(opts.network, get_preset(opts.preset).network))
    check_text_options(opts)


def check_text_options(opts: TrainingOptions) -> None:
    """Raise OptionsError for text options without data that has text embeddings, and for text data with a network
    family other than the U-Net's or with label dropout (a text network takes no class labels; text dropout drops its
    captions)."""
    text = "text_encoding" in opts.dataset
    family = opts.network.get("family", DEFAULT_FAMILY)
    if text and family != DEFAULT_FAMILY:
        raise OptionsError(f"the data has text embeddings, which the network family {family!r} cannot take: train "
                           f"it with --arch={DEFAULT_FAMILY}")
    given = [name for name in TEXT_OPTIONS if name in opts.network]
    if given and not text:
        raise OptionsError(f"{option_name(given[0])} shapes the attention over a caption's tokens, but the data has no "
                           "text embeddings (dataset_tool.py encode-text)")
    if text and opts.label_dropout:
        raise OptionsError("--label-dropout drops class labels, which a text network does not take; --text-dropout "
                           "drops its captions")


def _check_speed(opts: TrainingOptions) -> None:
    """How fast, not what: compilation, memory format, activation checkpoints, 16-bit CPU, the sharded EMA."""
    for name in ("compile", "channels_last"):
        _require(getattr(opts, name) in (None, True, False), name, getattr(opts, name), "True, False or None")
    for name in ("checkpoint_activations", "cpu_16bit", "ema_shard"):
        _require(type(getattr(opts, name)) is bool, name, getattr(opts, name), "True or False")


def _check_reporting(opts: TrainingOptions) -> None:
    """What rank 0 reports, beyond its fields' bounds and choices (the trackers, the metrics' names): a switch that is
    True or False, metrics at an interval that falls on snapshots, with a reference for those of images."""
    _require(type(opts.allow_data_change) is bool, "allow_data_change", opts.allow_data_change, "True or False")
    # A metric measures the snapshot just written, so it falls on snapshot times (0: at every snapshot).
    _require(not opts.snapshot or opts.metrics_every % opts.snapshot == 0, "metrics_every", opts.metrics_every,
             f"a multiple of --snapshot={opts.snapshot} (metrics measure the snapshot just written)")
    images = [name for name in opts.metrics if name != "loss"]
    _require(not images or isinstance(opts.metrics_ref, str) and opts.metrics_ref != "", "metrics_ref",
             opts.metrics_ref, f"reference statistics for --metrics={','.join(images)}")


def _check_paths(opts: TrainingOptions) -> None:
    """The run directory and the data: non-empty paths (or URLs)."""
    for name in ("run_dir", "data"):
        _require(isinstance(getattr(opts, name), str) and getattr(opts, name) != "", name, getattr(opts, name),
                 "a path")


# Each section's rules across its fields, run once its fields are within their bounds.
_RULES = {RECIPE: _check_recipe, NETWORK: _check_network, SPEED: _check_speed, REPORTING: _check_reporting,
          PATHS: _check_paths}


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
