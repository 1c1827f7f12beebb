"""The network of a run: its family (--arch, edm2.families), the options that shape it (the family's
hyperparameters: --channel-mult, --num-blocks, ... for the U-Net, --depth for mp-resnet) checked against the data, and
the architecture, encoder and weights a run takes over from a snapshot (--init)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os

import torch

import edm2.architectures  # noqa: F401  (every family --arch may name)
from edm2 import families
from edm2.encoders import Encoder
from edm2.errors import EDM2Error
from edm2.families import DEFAULT_FAMILY
from edm2.formats.snapshot import load_generator
from edm2.network_args import attention_levels, level_resolutions, whole_heads
from edm2.networks import UNET, Precond
from edm2.runtime import files
from training.presets import Preset, get_preset

# Precond arguments that a run sets from its data and options, not from an --init snapshot's architecture.
RUN_ARGUMENTS = ("img_resolution", "img_channels", "label_dim", "model_channels", "dropout", "use_fp16", "use_bf16")


class NetworkMisfit(EDM2Error):
    """A U-Net that does not fit the run's data, or an --init snapshot that contradicts the data or the options."""


def network_defaults(family: families.NetworkFamily) -> dict:
    """A family's defaults for the arguments that shape it: its constructor's (model_channels among them) and its
    hyperparameters'."""
    takes = inspect.signature(family.constructor).parameters.values()
    defaults = {p.name: p.default for p in takes if p.default is not inspect.Parameter.empty}
    return dict(defaults, **{name: f.default for name, f in family.fields().items()})


def effective(network: dict, name: str) -> int | list[int]:
    """The value of a network argument for these network arguments: theirs, else their family's default; sequences
    as lists."""
    value = network[name] if name in network else network_defaults(families.family_of(network))[name]
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else value


def hyperparameters_given(network: dict) -> dict:
    """The hyperparameters of network's family as its options would give them: theirs, None where they have none."""
    return {name: network.get(name) for name in families.family_of(network).fields()}


def option_name(name: str) -> str:
    """The train_edm2.py option of a network argument: --num-blocks for num_blocks."""
    return "--" + name.replace("_", "-")


def check_network_fits_data(resolution: int, channels: int, network: dict, explicit: bool = True) -> None:
    """Raise NetworkMisfit unless a U-Net of these arguments fits images of this resolution.

    Every level but the last halves the resolution, and the decoder must come back to the same sizes, so the
    resolution must divide by 2^(levels-1). Attention splits a level's channels into heads of channels_per_head
    channels; the level's channels must divide evenly into them. With explicit (the U-Net options were given, not
    all the preset's), every attention resolution must be one of the levels' and hold at least one head; a preset's
    attention resolutions that data of another size does not have are left out, as they always were.
    """
    mult, attention = effective(network, "channel_mult"), effective(network, "attn_resolutions")
    per_head, levels = effective(network, "channels_per_head"), len(mult)
    data = f"(data {resolution}x{resolution})"
    sizes = level_resolutions(resolution, levels)
    if sizes is None:
        raise NetworkMisfit(f"--channel-mult={','.join(map(str, mult))} has {levels} levels: the resolution "
                            f"{resolution} must be divisible by 2^{levels - 1} = {2 ** (levels - 1)} {data}")
    missing = [res for res in attention if res not in sizes]
    if explicit and missing:
        raise NetworkMisfit(f"attention at {missing[0]}x{missing[0]}, but the U-Net's levels are "
                            f"{', '.join(f'{n}x{n}' for n in sizes)}: choose --attn-resolutions among them {data}")
    # Text attention is in the arguments only where the options gave it (training.text_conditioning).
    text_missing = [res for res in network.get("text_attention", ()) if res not in sizes]
    if text_missing:
        raise NetworkMisfit(f"text attention at {text_missing[0]}x{text_missing[0]}, but the U-Net's levels are "
                            f"{', '.join(f'{n}x{n}' for n in sizes)}: choose --text-attention among them {data}")
    for level, res in attention_levels(sizes, attention):
        width = channels * mult[level]
        if not whole_heads(width, per_head) or (explicit and res in attention and width < per_head):
            raise NetworkMisfit(f"attention at {res}x{res} splits --channels={channels} x {mult[level]} = {width} "
                                f"channels into heads of {per_head}: the product must be a multiple of {per_head} "
                                f"{data}")


def differs_from_preset(network: dict, preset_network: dict) -> bool:
    """Whether network arguments shape the U-Net (its hyperparameters) otherwise than the preset's: only then are its
    attention resolutions checked strictly (check_network_fits_data's explicit). The preset's own, stored in a
    run's training_options.json and read back with --config, are the preset's choice, not the user's."""
    def shape(values: dict) -> dict:
        return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in values.items() if k in UNET.fields()}
    return shape(network) != shape(preset_network)


def network_options(preset: Preset, given: dict, arch: str = families.DEFAULT_FAMILY) -> dict:
    """The network arguments of a run of family arch: the preset's hyperparameters where arch has its family's
    (the U-Net's reach the paper's configurations of the U-Net, no other family), with the hyperparameters given
    on the command line (those not None) and the family's name (unless the U-Net's); NetworkMisfit names a given
    option that the family does not take, or one outside its bound."""
    family = families.get(arch)
    fields = family.fields()
    # The G U-Net's hyperparameters extend those of the paper's configurations (edm2.network_args) with text attention.
    theirs = families.get(preset.family).hyperparameters
    shared = issubclass(theirs, family.hyperparameters) or issubclass(family.hyperparameters, theirs)
    network = dict(preset.hyperparameters) if shared else {}
    for name, value in given.items():
        if value is not None and name not in fields:
            raise NetworkMisfit(f"{option_name(name)} does not shape the network family {arch!r}, which takes "
                                f"{', '.join(map(option_name, fields)) or 'no such options'}")
        if value is not None:
            network[name] = value
    for name, value in network.items():
        try:
            fields[name].metadata["bound"].check(name, value)
        except families.ArchitectureError as e:  # "name=value: expected ...", said as the option is typed
            raise NetworkMisfit(f"{option_name(name)}={_text(value)}: {str(e).partition(': ')[2]}") from None
    return network if arch == families.DEFAULT_FAMILY else dict(network, family=arch)


def check_family_fits_data(resolution: int, img_channels: int, label_dim: int, channels: int, network: dict) -> None:
    """Raise NetworkMisfit unless a network of another family than the U-Net (which check_network_fits_data checks
    option by option) can be built for this data: its constructor checks its arguments, on the meta device."""
    try:
        with torch.device("meta"):
            Precond(resolution, img_channels, label_dim, model_channels=channels, **network)
    except (TypeError, families.ArchitectureError) as e:
        raise NetworkMisfit(f"the network family {network.get('family')!r} cannot be built for this data "
                            f"({resolution}x{resolution}, {img_channels} channels): {e}") from None


@dataclasses.dataclass(frozen=True)
class InitSnapshot:
    """What a run started with --init takes from the snapshot: its architecture and encoder (weights come later,
    in TrainingState.create)."""

    path: str  # absolute path or URL, as recorded in the run's options
    network_kwargs: dict  # the snapshot network's Precond arguments
    encoder: Encoder

    @property
    def channels(self) -> int:
        """model_channels of the snapshot's U-Net."""
        return effective(self.network_kwargs, "model_channels")

    @property
    def network(self) -> dict:
        """The Precond arguments that a run's options carry in `network` (all but RUN_ARGUMENTS; the family only when
        it is not the U-Net, as the options record it)."""
        return {k: v for k, v in self.network_kwargs.items() if k not in RUN_ARGUMENTS
                and (k, v) != ("family", families.DEFAULT_FAMILY)}


def init_path(path_or_url: str) -> str:
    """--init as a run records it: URLs as given, files as absolute paths (a rerun from elsewhere is the same)."""
    return path_or_url if files.is_url(path_or_url) else os.path.abspath(path_or_url)


def read_init(path_or_url: str) -> InitSnapshot:
    """The architecture and encoder of a snapshot of ours or a release pickle (SnapshotError if it has none); a file
    unchanged since it was last read here (same device, inode, size and modification time) is not parsed again."""
    path = init_path(path_or_url)
    kwargs, encoder = _architecture(path, None if files.is_url(path) else _file_signature(path))
    return InitSnapshot(path, dict(kwargs), encoder)


def _file_signature(path: str) -> tuple | None:
    """What changes when a file is replaced or rewritten; None for a path that cannot be read (the loader says why)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=2)
def _architecture(path: str, signature: tuple | None) -> tuple[dict, Encoder]:
    # train_edm2.py and train()'s preflight both check --init before a run starts: a large release pickle is parsed
    # once for both (its weights are read again, from the file, when the run takes them over).
    net, encoder, _ = load_generator(path)
    return dict(net.init_kwargs), encoder


def init_weights(path_or_url: str) -> dict[str, torch.Tensor]:
    """The float32 weights of the snapshot a run starts from (--init)."""
    return load_generator(path_or_url)[0].state_dict()


def network_family(network: dict) -> str:
    """The network family that network arguments build (edm2.families): theirs, else the release's U-Net."""
    return network.get("family", DEFAULT_FAMILY)


def check_init(init: InitSnapshot, *, resolution: int, num_channels: int, label_dim: int, encoder: Encoder,
               given: dict, preset: str | None = None, text: dict | None = None) -> None:
    """Raise NetworkMisfit naming what contradicts the --init snapshot: data of another resolution, channel count
    or encoder, labels beyond the network's classes (label_dim: the data's highest label plus one, 0 for
    --cond=False; data holding some of the classes is fine), text embeddings (text: the data's text_encoding record,
    None without) of other features or tokens than the network takes, a preset of another network family, or
    architecture options (given: channels and the family's hyperparameters as given on the command line, None where
    not given)."""
    kwargs, name = init.network_kwargs, os.path.basename(init.path)
    ours, theirs = get_preset(preset).family if preset else None, network_family(kwargs)
    if ours not in (None, theirs):
        raise NetworkMisfit(f"--preset={preset} trains the network family {ours!r}, but {name} is of family "
                            f"{theirs!r}; choose a preset of {theirs!r}")
    if type(encoder) is not type(init.encoder):
        raise NetworkMisfit(f"{name} works on {type(init.encoder).__name__} data but the data is for "
                            f"{type(encoder).__name__}")
    channels = encoder.out_channels(num_channels)
    if (resolution, channels) != (kwargs["img_resolution"], kwargs["img_channels"]):
        raise NetworkMisfit(f"{name} is a {kwargs['img_resolution']}x{kwargs['img_resolution']} network with "
                            f"{kwargs['img_channels']} channels; the data gives {resolution}x{resolution} with "
                            f"{channels}")
    takes_text = (kwargs.get("text_dim", 0), kwargs.get("text_tokens", 0))
    if takes_text != ((text["dim"], text["tokens"]) if text else (0, 0)):
        has = f"{text['tokens']} tokens of {text['dim']} features" if text else "none"
        wants = f"{takes_text[1]} tokens of {takes_text[0]} features" if takes_text[0] else "none"
        raise NetworkMisfit(f"{name} takes text embeddings of {wants}; the data has {has}")
    classes = kwargs["label_dim"]
    if text is None and (bool(label_dim) != bool(classes) or label_dim > classes):
        what = "an unconditional network: train it with --cond=False" if not classes else (
            f"a network of {classes} classes: train it with --cond=True on data labeled within 0-{classes - 1}")
        have = "--cond=False" if not label_dim else f"the data's labels go up to {label_dim - 1}"
        raise NetworkMisfit(f"{name} is {what} ({have})")
    takes = families.family_of(kwargs).fields()
    for option, value in given.items():
        if value is None:
            continue
        if option != "channels" and option not in takes:
            raise NetworkMisfit(f"{option_name(option)} does not shape {name}, a network of family "
                                f"{network_family(kwargs)!r}; leave it out")
        theirs = effective(kwargs, "model_channels" if option == "channels" else option)
        if (list(value) if isinstance(value, (list, tuple)) else value) != theirs:
            raise NetworkMisfit(f"{option_name(option)}={_text(value)} contradicts {name}, whose network has "
                                f"{_text(theirs)}; leave it out to take the snapshot's")


def _text(value) -> str:
    """An option value as typed: lists comma-separated, 'none' for the empty list."""
    return (",".join(map(str, value)) or "none") if isinstance(value, (list, tuple)) else str(value)
