"""Network constructor arguments checked before anything is built: types, ranges and sane upper bounds.

The arguments come from Python, from our snapshots' metadata and from the release's pickles. The U-Net, its
preconditioning and the toy denoiser check them here first, so that none of them builds (or allocates) anything
for an argument it cannot use, and arguments read from a file are refused with one line naming the argument.

The U-Net's layout (unet_layout, Figure 21) follows from its arguments: the G U-Net (edm2.networks) and the paper's
configurations B to E (edm2.architectures.ladder) build their own layers over it, with the release's state-dict names.

A network family's hyperparameters (edm2.families) are a dataclass of `hyperparameter` fields: each its default,
its bound and its help, from which train_edm2.py makes the family's options. The U-Net's are TextUNetHyperparameters
(UNetHyperparameters, which the paper's configurations B to F share, and the text attention's).
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from typing import Any, Iterator, Mapping, Sequence

from edm2.layers import TEXT_ATTENTION_KINDS, ArchitectureError

MAX_CHANNELS = 4096  # model_channels, logvar_channels, channels_per_head, hidden_dim: EDM2-XXL has 448
MAX_MULT = 64  # channel_mult and friends: the release's largest is 4
MAX_LEVELS = 16  # U-Net levels and attention resolutions: the release has 4 levels
MAX_BLOCKS = 64  # blocks per level (num_blocks), layers of the toy model: the release has 3 and 4
MAX_RESOLUTION = 8192  # img_resolution: the release's largest is 64 (latents of 512x512 images)
MAX_IMG_CHANNELS = 256  # latents have 4, RGB images 3
MAX_LABELS = 1_000_000  # ImageNet has 1000 classes
MAX_SCALE = 1000.0  # sigma_data and clip_act: the release uses 0.5 and 256
MAX_TEXT_DIM = 16384  # a text encoder's features: T5-XXL has 4096, CLIP ViT-bigG 1280
MAX_TEXT_TOKENS = 4096  # tokens of a caption: NeMo's Imagen takes 128, CLIP 77
BLOCK_ARGS = ("channels_per_head", "dropout", "res_balance", "attn_balance", "clip_act", "modulation")
# How a block's embedding modulates its residual branch: the release's c = 1 + gain W emb ('plain'), or sCM's adaptive
# double normalization adapted to the MP block, c = 1 + gain normalize(W emb) ('double-norm', Lu and Song 2025,
# Section 4.1), whose deviation from 1 has RMS |gain| whatever the embedding's magnitude.
MODULATIONS = ("plain", "double-norm")
# The U-Net's switches for consistency models and their defaults (the release's networks): a Precond records a switch
# in its constructor arguments only when it is not its default, so that the release's networks keep theirs.
NETWORK_SWITCHES = {"modulation": "plain", "guidance_embedding": False}


class _Short(reprlib.Repr):
    """repr of a value from a file, bounded in length whatever the value is."""

    def repr_int(self, x: int, level: int) -> str:
        # str() of an integer of more than 4300 digits raises ValueError.
        return repr(x) if x.bit_length() <= 64 else f"<a {x.bit_length()}-bit integer>"

    def repr_instance(self, x: object, level: int) -> str:
        # Other objects' repr may be long or costly (a pickled module's record repr walks all of it).
        return repr(x) if x is None or isinstance(x, (bool, float)) else f"<{type(x).__name__}>"


_short = _Short()
_short.maxstring = _short.maxother = 40


def shown(value: object) -> str:
    """A value as a message may show it: short, whatever it is."""
    return _short.repr(value)


def _refuse(name: str, value: object, expected: str) -> ArchitectureError:
    return ArchitectureError(f"{name}={shown(value)}: expected {expected}")


def integer(name: str, value: object, low: int, high: int) -> int:
    """value, unless it is not an int (bool is none) from low to high: ArchitectureError naming the argument."""
    if type(value) is not int or not low <= value <= high:
        raise _refuse(name, value, f"an integer from {low} to {high}")
    return value


def real(name: str, value: object, low: float, high: float, low_open: bool = False) -> float:
    """value as a float, unless it is not a finite number in [low, high] (or (low, high])."""
    # An int compares exactly, however long; converting one of 400 digits to float would raise OverflowError.
    number = type(value) is int or (type(value) is float and math.isfinite(value))
    number = number and low <= value <= high
    if not number or (low_open and value == low):
        raise _refuse(name, value, f"a number in {'(' if low_open else '['}{low}, {high}]")
    return float(value)


def integers(name: str, value: object, low: int, high: int, min_len: int, max_len: int) -> list[int]:
    """value as a list, unless it is not a list or tuple of min_len to max_len integers from low to high."""
    if not isinstance(value, (list, tuple)) or not min_len <= len(value) <= max_len:
        raise _refuse(name, value, f"a list of {min_len} to {max_len} integers")
    return [integer(f"{name}[{i}]", v, low, high) for i, v in enumerate(value)]


def flag(name: str, value: object) -> bool:
    """value, unless it is not a bool."""
    if type(value) is not bool:
        raise _refuse(name, value, "True or False")
    return value


@dataclasses.dataclass(frozen=True)
class IntegerBound:
    """The bound of an integer argument: from low to high."""

    low: int
    high: int

    def check(self, name: str, value: object) -> int:
        """value, unless the bound refuses it: ArchitectureError naming the argument."""
        return integer(name, value, self.low, self.high)


@dataclasses.dataclass(frozen=True)
class IntegersBound:
    """The bound of a list argument: min_len to max_len integers, each from low to high."""

    low: int
    high: int
    min_len: int
    max_len: int

    def check(self, name: str, value: object) -> list[int]:
        """value as a list, unless the bound refuses it: ArchitectureError naming the argument."""
        return integers(name, value, self.low, self.high, self.min_len, self.max_len)


@dataclasses.dataclass(frozen=True)
class ChoiceBound:
    """The bound of a string argument: one of choices."""

    choices: tuple[str, ...]

    def check(self, name: str, value: object) -> str:
        """value, unless it is not one of the choices: ArchitectureError naming the argument."""
        if not isinstance(value, str) or value not in self.choices:
            raise _refuse(name, value, f"one of {', '.join(self.choices)}")
        return value


Bound = IntegerBound | IntegersBound | ChoiceBound


def hyperparameter(default: object, bound: Bound, help: str) -> Any:
    """A field of a family's hyperparameters: its default, the bound of its values and its --help text."""
    return dataclasses.field(default=default, metadata=dict(bound=bound, help=help))


def hyperparameter_fields(hyperparameters: type) -> dict[str, dataclasses.Field]:
    """The fields of a hyperparameters dataclass by name, in their order."""
    return {f.name: f for f in dataclasses.fields(hyperparameters)}


def check_hyperparameters(hyperparameters: type, values: Mapping[str, object]) -> None:
    """Raise ArchitectureError unless every value is a field of the hyperparameters dataclass within its bound."""
    fields = hyperparameter_fields(hyperparameters)
    for name, value in values.items():
        if name not in fields:
            raise ArchitectureError(f"unknown network argument {shown(name)}: the hyperparameters are "
                                    f"{', '.join(fields) or 'none'}")
        fields[name].metadata["bound"].check(name, value)


@dataclasses.dataclass(frozen=True)
class UNetHyperparameters:
    """The U-Net's hyperparameters (the release's defaults), and those of the paper's configurations B to F."""

    channel_mult: tuple[int, ...] = hyperparameter(
        (1, 2, 3, 4), IntegersBound(1, MAX_MULT, 1, MAX_LEVELS),
        "Channel multiplier per U-Net level, e.g. 1,2,2 (each level after the first halves the resolution)")
    num_blocks: int = hyperparameter(3, IntegerBound(1, MAX_BLOCKS), "Encoder blocks per level (decoder: one more)")
    attn_resolutions: tuple[int, ...] = hyperparameter(
        (16, 8), IntegersBound(1, MAX_RESOLUTION, 0, MAX_LEVELS),
        "Resolutions with self-attention, e.g. 16,8; empty for none (the lowest level's first decoder block always "
        "has it)")
    channels_per_head: int = hyperparameter(64, IntegerBound(1, MAX_CHANNELS), "Channels per attention head")


@dataclasses.dataclass(frozen=True)
class TextUNetHyperparameters(UNetHyperparameters):
    """The G U-Net's hyperparameters: the release's and, for a dataset with text, where it attends to the caption's
    tokens (the paper's configurations B to F take UNetHyperparameters alone)."""

    text_attention: tuple[int, ...] = hyperparameter(
        (16, 8), IntegersBound(1, MAX_RESOLUTION, 0, MAX_LEVELS),
        "Resolutions with attention over a caption's tokens (data with text embeddings), e.g. 16,8; none for the "
        "pooled embedding alone; a preset's default is its --attn-resolutions")
    text_attention_kind: str = hyperparameter(
        "cross", ChoiceBound(TEXT_ATTENTION_KINDS),
        "Attention over the text tokens: cross (queries from the image, keys and values from the text) or fused "
        "(keys and values of the image and the text)")


_UNET_BOUNDS = {name: f.metadata["bound"] for name, f in hyperparameter_fields(TextUNetHyperparameters).items()}


def check_unet(args: Mapping[str, object], block_args: Mapping[str, object]) -> None:
    """Raise ArchitectureError unless the UNet arguments (args holds all of them, and may hold more) and the Block
    arguments (defaults filled in) describe a U-Net that can be built and run: each in its range, the resolution halving at every level, and
    the channels of every level with attention splitting into whole heads."""
    unknown = sorted(map(shown, set(block_args) - set(BLOCK_ARGS)))
    if unknown:
        raise ArchitectureError(f"unknown network argument {unknown[0]}")
    resolution = integer("img_resolution", args["img_resolution"], 1, MAX_RESOLUTION)
    integer("img_channels", args["img_channels"], 1, MAX_IMG_CHANNELS)
    integer("label_dim", args["label_dim"], 0, MAX_LABELS)
    channels = integer("model_channels", args["model_channels"], 1, MAX_CHANNELS)
    mult = _UNET_BOUNDS["channel_mult"].check("channel_mult", args["channel_mult"])
    for name in ("channel_mult_noise", "channel_mult_emb"):
        if args[name] is not None:
            integer(name, args[name], 1, MAX_MULT)
    _UNET_BOUNDS["num_blocks"].check("num_blocks", args["num_blocks"])
    attention = _UNET_BOUNDS["attn_resolutions"].check("attn_resolutions", args["attn_resolutions"])
    for name in ("label_balance", "concat_balance", "res_balance", "attn_balance"):
        real(name, {**args, **block_args}[name], 0, 1)
    real("dropout", block_args["dropout"], 0, 1)
    modulation = block_args.get("modulation", NETWORK_SWITCHES["modulation"])
    if modulation not in MODULATIONS:
        raise _refuse("modulation", modulation, f"one of {', '.join(MODULATIONS)}")
    flag("guidance_embedding", args.get("guidance_embedding", NETWORK_SWITCHES["guidance_embedding"]))
    if block_args["clip_act"] is not None:
        real("clip_act", block_args["clip_act"], 0, MAX_SCALE, low_open=True)
    per_head = _UNET_BOUNDS["channels_per_head"].check("channels_per_head", block_args["channels_per_head"])
    levels = len(mult)
    sizes = level_resolutions(resolution, levels)
    if sizes is None:
        raise ArchitectureError(f"img_resolution={resolution} does not divide by 2^{levels - 1}, as the "
                                f"{levels} levels of channel_mult={mult} need")
    for level, res in attention_levels(sizes, attention):
        width = channels * mult[level]
        if not whole_heads(width, per_head):
            raise ArchitectureError(f"attention at {res}x{res} splits {width} channels into {width // per_head} "
                                    f"heads of channels_per_head={per_head}: they do not divide evenly")


def check_text(args: Mapping[str, object], per_head: int) -> None:
    """Raise ArchitectureError unless the U-Net's text arguments (args holds all UNet arguments, check_unet passed)
    describe text conditioning it can build: features and tokens in range, no class labels beside them, and whole
    attention heads at every text attention resolution (a level narrower than one head has none, as for
    self-attention)."""
    text_dim = integer("text_dim", args["text_dim"], 0, MAX_TEXT_DIM)
    integer("text_tokens", args["text_tokens"], 1 if text_dim else 0, MAX_TEXT_TOKENS if text_dim else 0)
    attention = _UNET_BOUNDS["text_attention"].check("text_attention", args["text_attention"])
    _UNET_BOUNDS["text_attention_kind"].check("text_attention_kind", args["text_attention_kind"])
    if not text_dim:
        if attention:
            raise ArchitectureError("text_attention needs text_dim: attention over text tokens for a network without "
                                    "text")
        return
    if args["label_dim"]:
        raise ArchitectureError(f"label_dim={shown(args['label_dim'])} with text_dim={text_dim}: a text network "
                                "takes a caption's condition, not class labels (label_dim 0)")
    sizes = level_resolutions(args["img_resolution"], len(args["channel_mult"]))
    for level, res in enumerate(sizes):
        width = args["model_channels"] * args["channel_mult"][level]
        if res in attention and not whole_heads(width, per_head):
            raise ArchitectureError(f"text attention at {res}x{res} splits {width} channels into {width // per_head} "
                                    f"heads of channels_per_head={per_head}: they do not divide evenly")


def level_resolutions(resolution: int, levels: int) -> list[int] | None:
    """The resolutions of a U-Net's levels, each half the one before; None where the resolution does not divide by
    2^(levels-1), so that the decoder could not come back up to the encoder's sizes."""
    if resolution % 2 ** (levels - 1):
        return None
    return [resolution >> level for level in range(levels)]


def attention_levels(sizes: list[int], attention: Sequence[int]) -> list[tuple[int, int]]:
    """(level, resolution) of each level with self-attention: those at attention's resolutions, and the lowest,
    whose first decoder block always has it (as in the release)."""
    return [(level, res) for level, res in enumerate(sizes) if res in attention or level == len(sizes) - 1]


def whole_heads(width: int, per_head: int) -> bool:
    """Whether width channels split evenly into width // per_head attention heads (none, when fewer than per_head:
    that block has no attention)."""
    heads = width // per_head
    return not heads or width % heads == 0


@dataclasses.dataclass(frozen=True)
class Slot:
    """One layer of a U-Net's encoder or decoder (Figure 21): where it sits and what it does."""

    side: str  # 'enc' or 'dec'
    name: str  # its key in the side's ModuleDict, e.g. '16x16_block0': the state-dict names
    in_channels: int
    out_channels: int
    resample_mode: str = "keep"  # 'down' or 'up' for the blocks between levels
    attention: bool = False
    conv: bool = False  # the encoder's first layer: a 3x3 convolution, no block


def unet_layout(img_resolution: int, in_channels: int, cblock: Sequence[int], num_blocks: int,
                attn_resolutions: Sequence[int]) -> Iterator[Slot]:
    """The layers of a U-Net of the release's layout (Figure 21), in the order they are built: per level an input
    convolution (first level) or a downsampling block, then num_blocks blocks; back up, two blocks at the lowest
    level (the first with attention) or an upsampling block, then num_blocks + 1 blocks, each taking a skip."""
    skips, cout = [], in_channels
    for level, channels in enumerate(cblock):
        res = img_resolution >> level
        if level == 0:
            yield Slot("enc", f"{res}x{res}_conv", cout, channels, conv=True)
            cout = channels
        else:
            yield Slot("enc", f"{res}x{res}_down", cout, cout, "down")
        skips.append(cout)
        for idx in range(num_blocks):
            yield Slot("enc", f"{res}x{res}_block{idx}", cout, channels, attention=res in attn_resolutions)
            cout = channels
            skips.append(cout)
    for level, channels in reversed(list(enumerate(cblock))):
        res = img_resolution >> level
        if level == len(cblock) - 1:
            yield Slot("dec", f"{res}x{res}_in0", cout, cout, attention=True)
            yield Slot("dec", f"{res}x{res}_in1", cout, cout)
        else:
            yield Slot("dec", f"{res}x{res}_up", cout, cout, "up")
        for idx in range(num_blocks + 1):
            cin, cout = cout + skips.pop(), channels
            yield Slot("dec", f"{res}x{res}_block{idx}", cin, cout, attention=res in attn_resolutions)


# c_noise of Precond: EDM's ln(sigma) / 4 (EDM Eq. 7, the release's) or TrigFlow's t = arctan(sigma / sigma_data), the
# embedding of sCM's Section 4.1 whose derivative in t stays bounded.
TIME_EMBEDDINGS = ("edm", "trigflow")


def check_precond(sigma_data: object, logvar_channels: object, use_fp16: object, use_bf16: object,
                  time_embedding: object = "edm") -> None:
    """Raise ArchitectureError unless Precond's own arguments are in range (the U-Net checks the rest)."""
    real("sigma_data", sigma_data, 0, MAX_SCALE, low_open=True)
    integer("logvar_channels", logvar_channels, 1, MAX_CHANNELS)
    flag("use_fp16", use_fp16)
    flag("use_bf16", use_bf16)
    if time_embedding not in TIME_EMBEDDINGS:
        shown = repr(time_embedding) if isinstance(time_embedding, str) and len(time_embedding) <= 40 else "that value"
        raise ArchitectureError(f"time_embedding {shown} is not one of {', '.join(TIME_EMBEDDINGS)}")


def is_default_switch(name: str, value: object) -> bool:
    """Whether a network argument is one of NETWORK_SWITCHES at its default (and so is not recorded)."""
    default = NETWORK_SWITCHES.get(name, ...)
    return type(value) is type(default) and value == default


def check_toy(in_dim: object, num_layers: object, hidden_dim: object, sigma_data: object) -> None:
    """Raise ArchitectureError unless the toy denoiser's arguments are in range."""
    integer("in_dim", in_dim, 1, MAX_CHANNELS)
    integer("num_layers", num_layers, 1, MAX_BLOCKS)
    integer("hidden_dim", hidden_dim, 1, MAX_CHANNELS)
    real("sigma_data", sigma_data, 0, MAX_SCALE, low_open=True)
