"""Conversions between uint8 pixels and network inputs: RGB scaling, or the latents of a diffusers VAE.

Pixels are first encoded into "raw latents" (what a dataset stores), then into the normalized
"final latents" the network sees; decoding goes from final latents straight back to pixels.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from edm2.errors import EDM2Error, one_line

DEFAULT_VAE = "stabilityai/sd-vae-ft-mse"
PIXELS = "uint8"  # the stored dtype of encodings whose datasets hold PNG pixels
LATENTS = "float32"  # the stored dtype of encodings whose datasets hold .npy latents
MAX_LATENT_CHANNELS = 1024
MAX_NAME_CHARS = 4096
MAX_VAE_BATCH = 1 << 20  # images per VAE call, as edm2.runtime.limits.MAX_BATCH bounds a batch


class EncoderError(EDM2Error):
    """The VAE cannot be loaded, or an encoder cannot be built as asked; the message names what and why."""


class EncoderSettingsError(EncoderError, ValueError):
    """Settings that describe no encoder; also a ValueError, as which readers of stored settings catch it."""


class Encoder:
    """Common interface: encode = encode_latents(encode_pixels(x)); `encoding` is the name under which ENCODINGS
    registers the class and a dataset records what it holds (dataset.json "encoding").

    An encoding's settings are its constructor's named arguments, recorded as each encoder is built (so a subclass
    cannot leave one out): a dataset records them (dataset_record) and encoder_for_dataset passes them back.
    """

    encoding = ""
    stored_dtype = PIXELS  # what its datasets store: PIXELS (PNG files, uint8 shards) or LATENTS (.npy, float32)
    run_settings: frozenset[str] = frozenset()  # arguments that say how to run it, not what a dataset holds

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _recording(cls.__dict__["__init__"])

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW pixels -> float32 network input."""
        return self.encode_latents(self.encode_pixels(x))

    def encode_pixels(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW pixels -> raw latents as stored in a dataset."""
        raise NotImplementedError

    def encode_latents(self, x: torch.Tensor) -> torch.Tensor:
        """Raw latents -> float32 network input."""
        raise NotImplementedError

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Network output -> uint8 NCHW pixels."""
        raise NotImplementedError

    def out_channels(self, in_channels: int) -> int:
        """Channels of the network input for a dataset with in_channels channels."""
        raise NotImplementedError

    def config(self) -> dict:
        """JSON-serializable settings, the class and every constructor argument; encoder_from_config() rebuilds the
        encoder."""
        return {"class": type(self).__name__, **self.__dict__.get("_settings", {})}

    def dataset_record(self) -> dict:
        """What a dataset of this encoding records in dataset.json: its name and the settings that rebuild it."""
        settings = self.settings()
        return {"encoding": self.encoding, **({"encoding_settings": settings} if settings else {})}

    def settings(self) -> dict:
        """The constructor arguments that a dataset records (all but run_settings; encoder_for_dataset passes them
        back)."""
        return {name: value for name, value in self.__dict__.get("_settings", {}).items()
                if name not in self.run_settings}

    def init(self, device: torch.device) -> None:
        """Load now, onto device, what decoding needs (pixels need nothing), so that it fails before any sampling."""


def _plain(value: object) -> object:
    """A setting as JSON holds it: sequences as lists, NumPy numbers as Python's."""
    if isinstance(value, (tuple, list, np.ndarray)):
        return [_plain(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value


def _recording(init: Callable) -> Callable:
    """init, recording its named arguments (defaults included) as the encoder's settings before it runs; the
    outermost constructor's are kept when a subclass's calls its parent's."""
    signature = inspect.signature(init)
    unnamed = [p.name for p in list(signature.parameters.values())[1:]
               if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if unnamed:
        raise TypeError(f"{init.__qualname__}: an encoder's settings are named arguments, which {unnamed[0]!r} is "
                        f"not; a dataset could not record it")

    @functools.wraps(init)
    def recording_init(self, *args, **kwargs):
        if "_settings" not in self.__dict__:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            self._settings = {name: _plain(value) for name, value in list(bound.arguments.items())[1:]}
        init(self, *args, **kwargs)
    return recording_init


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool) and math.isfinite(value)


def _numbers(name: str, values: object, count: int | None = None, positive: bool = False) -> list[float]:
    """A setting that holds one finite number per latent channel (count of them when given)."""
    ok = (isinstance(values, (list, tuple, np.ndarray)) and 1 <= len(values) <= MAX_LATENT_CHANNELS
          and all(_is_number(v) and (v > 0 or not positive) for v in values))
    if not ok or (count is not None and len(values) != count):
        length = f"{count}" if count is not None else f"1 to {MAX_LATENT_CHANNELS}"
        raise EncoderSettingsError(f"{name}={_plain(values)!r:.80}: expected {length} finite "
                                   f"{'positive ' if positive else ''}numbers, one per latent channel")
    return [float(v) for v in values]


def _number(name: str, value: object, positive: bool = False) -> float:
    if not _is_number(value) or (positive and value <= 0):
        raise EncoderSettingsError(f"{name}={value!r:.80}: expected a finite {'positive ' if positive else ''}number")
    return float(value)


class StandardRGBEncoder(Encoder):
    """RGB pixels scaled to [-1, 1] (release)."""

    encoding = "pixels"

    def encode_pixels(self, x: torch.Tensor) -> torch.Tensor:
        """Pixels are stored as they are."""
        return x

    def encode_latents(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 [0, 255] -> float32 [-1, 1]."""
        return x.to(torch.float32) / 127.5 - 1

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """[-1, 1] -> uint8; the +128 (rather than +127.5) rounds to nearest when truncating."""
        return (x.to(torch.float32) * 127.5 + 128).clip(0, 255).to(torch.uint8)

    def out_channels(self, in_channels: int) -> int:
        """RGB datasets feed the network as they are."""
        return in_channels


class StabilityVAEEncoder(Encoder):
    """Latents of a diffusers AutoencoderKL, normalized as in paper Appendix B.1 (sigma_data = 0.5):
    final = (raw - raw_mean) / raw_std * final_std + final_mean, per latent channel.

    The VAE is loaded on first use, onto the device of the input, and is never pickled.
    """

    encoding = "stability-vae"
    stored_dtype = LATENTS
    run_settings = frozenset({"batch_size"})

    def __init__(self, vae_name: str = DEFAULT_VAE,
                 raw_mean: Sequence[float] = (5.81, 3.25, 0.12, -2.15),
                 raw_std: Sequence[float] = (4.17, 4.62, 3.71, 3.28),
                 final_mean: float = 0.0, final_std: float = 0.5, batch_size: int = 8):
        raw_mean = _numbers("raw_mean", raw_mean)
        raw_std = _numbers("raw_std", raw_std, count=len(raw_mean), positive=True)
        final_mean, final_std = _number("final_mean", final_mean), _number("final_std", final_std, positive=True)
        # float32 arithmetic as in the release, so scale/bias equal the values its pickles store.
        scale = np.float32(final_std) / np.asarray(raw_std, dtype=np.float32)
        bias = np.float32(final_mean) - np.asarray(raw_mean, dtype=np.float32) * scale
        self._setup(vae_name, scale, bias, batch_size)

    @classmethod
    def from_scale_bias(cls, vae_name: str, scale: Sequence[float], bias: Sequence[float],
                        batch_size: int = 8) -> StabilityVAEEncoder:
        """Encoder with final = raw * scale + bias given directly (as the release's pickles store it)."""
        encoder = cls.__new__(cls)
        encoder._settings = {"vae_name": str(vae_name), "batch_size": batch_size}  # its normalization: config()
        encoder._setup(vae_name, np.asarray(scale, dtype=np.float32), np.asarray(bias, dtype=np.float32),
                       batch_size)
        return encoder

    def _setup(self, vae_name: str, scale: np.ndarray, bias: np.ndarray, batch_size: int) -> None:
        if scale.shape != bias.shape or scale.ndim != 1:
            raise EncoderSettingsError(f"scale and bias must be equal-length vectors, got {scale.shape} and "
                                       f"{bias.shape}")
        if not isinstance(vae_name, str) or not 0 < len(vae_name) <= MAX_NAME_CHARS:
            raise EncoderSettingsError(f"vae_name={vae_name!r:.80}: expected a hub name or a directory")
        if (not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool)
                or not 1 <= batch_size <= MAX_VAE_BATCH):
            raise EncoderSettingsError(f"batch_size must be an integer in [1, {MAX_VAE_BATCH}], got {batch_size!r:.40}")
        self.vae_name = str(vae_name)
        self.scale = scale
        self.bias = bias
        self.batch_size = int(batch_size)
        self._vae = None

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _vae=None)

    def init(self, device: torch.device) -> None:
        """Load the VAE now (it is otherwise loaded on first use), onto device."""
        self._vae_on(device)

    def _vae_on(self, device: torch.device):
        if self._vae is None:
            vae = load_vae(self.vae_name)
            channels = getattr(vae.config, "latent_channels", len(self.scale))
            if channels != len(self.scale):
                raise EncoderError(f"the VAE '{self.vae_name}' has {channels} latent channels; the encoding "
                                   f"{self.encoding!r} is set for {len(self.scale)}")
            self._vae = vae
        if next(self._vae.parameters()).device != torch.device(device):
            self._vae.to(device)
        return self._vae

    def _per_channel(self, values: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.float32, device=like.device).reshape(1, -1, 1, 1)

    def encode_pixels(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW -> float32 concat(mean, std) of the latent distribution (8 channels for SD)."""
        vae = self._vae_on(x.device)
        x = x.to(torch.float32) / 255  # the release feeds the VAE [0, 1] pixels
        with torch.no_grad():
            parts = []
            for batch in x.split(self.batch_size):
                dist = vae.encode(batch).latent_dist
                parts.append(torch.cat([dist.mean, dist.std], dim=1))
        return torch.cat(parts)

    def encode_latents(self, x: torch.Tensor) -> torch.Tensor:
        """Draw a latent from N(mean, std^2) with the global torch RNG, then normalize it."""
        mean, std = x.to(torch.float32).chunk(2, dim=1)
        x = mean + torch.randn_like(mean) * std
        return x * self._per_channel(self.scale, x) + self._per_channel(self.bias, x)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Undo the normalization, run the VAE decoder, return uint8 pixels."""
        x = x.to(torch.float32)
        return self.decode_raw((x - self._per_channel(self.bias, x)) / self._per_channel(self.scale, x))

    def decode_raw(self, x: torch.Tensor) -> torch.Tensor:
        """Raw (unnormalized) latents -> uint8 NCHW pixels; clamped to [0, 1] and truncated, as the release."""
        vae = self._vae_on(x.device)
        with torch.no_grad():
            pixels = torch.cat([vae.decode(batch).sample for batch in x.to(torch.float32).split(self.batch_size)])
        return (pixels.clamp(0, 1) * 255).to(torch.uint8)

    def out_channels(self, in_channels: int) -> int:
        """A dataset stores mean and std, so the network sees half its channels."""
        if in_channels % 2:
            raise EncoderSettingsError(f"latent datasets store mean and std (an even channel count), "
                                       f"got {in_channels}")
        if in_channels != 2 * len(self.scale):
            raise EncoderSettingsError(f"the data's {in_channels} channels hold mean and std of {in_channels // 2} "
                                       f"latent channels; raw_mean and raw_std give {len(self.scale)}")
        return in_channels // 2

    def config(self) -> dict:
        """VAE name, normalization and batch size; floats are the exact float32 values."""
        return {"class": "StabilityVAEEncoder", "vae_name": self.vae_name, "scale": self.scale.tolist(),
                "bias": self.bias.tolist(), "batch_size": self.batch_size}


class DiffusersVAEEncoder(StabilityVAEEncoder):
    """Latents of any diffusers AutoencoderKL (a hub name or a local directory, vae_name) with latent_channels
    channels, normalized by the statistics of its latents as StabilityVAEEncoder (raw_mean and raw_std: one number
    for every channel, or one per channel): a second VAE, for one the release did not use."""

    encoding = "diffusers-vae"

    def __init__(self, vae_name: str, latent_channels: int, raw_mean: float | Sequence[float],
                 raw_std: float | Sequence[float], final_mean: float = 0.0, final_std: float = 0.5,
                 batch_size: int = 8):
        if type(latent_channels) is not int or not 1 <= latent_channels <= MAX_LATENT_CHANNELS:
            raise EncoderSettingsError(f"latent_channels={latent_channels!r:.40}: expected an integer in "
                                       f"[1, {MAX_LATENT_CHANNELS}]")
        raw_mean, raw_std = ([value] * latent_channels if _is_number(value) else value for value in (raw_mean, raw_std))
        super().__init__(vae_name, _numbers("raw_mean", raw_mean, latent_channels),
                         _numbers("raw_std", raw_std, latent_channels, positive=True), final_mean, final_std,
                         batch_size)

    def config(self) -> dict:
        """The class and its constructor's arguments (encoder_from_config)."""
        return Encoder.config(self)


class LinearRGBEncoder(Encoder):
    """sRGB pixels stored as they are, seen by the network in linear light, ((x / 255) ** gamma) * 2 - 1: the
    worked example of a data encoding (docs/extending.md)."""

    encoding = "linear-rgb"

    def __init__(self, gamma: float = 2.2):
        if type(gamma) not in (int, float) or not 0.1 <= gamma <= 10:
            raise EncoderSettingsError(f"gamma={gamma!r}: expected a number in [0.1, 10]")
        self.gamma = float(gamma)

    def encode_pixels(self, x: torch.Tensor) -> torch.Tensor:
        """PNG pixels are stored as they are."""
        return x

    def encode_latents(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 sRGB -> linear light in [-1, 1]."""
        return (x.to(torch.float32) / 255) ** self.gamma * 2 - 1

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Linear light in [-1, 1] -> uint8 sRGB, rounded to nearest."""
        return ((x.to(torch.float32) + 1) / 2).clip(0, 1).pow(1 / self.gamma).mul(255).add(0.5).to(torch.uint8)

    def out_channels(self, in_channels: int) -> int:
        """The network sees the stored channels."""
        return in_channels


_VAE_KEYS = {"vae_name", "scale", "bias", "batch_size"}

# The data encodings a dataset may hold, by the name dataset.json and a shard index record ("encoding", with its
# constructor's arguments as "encoding_settings" if any): what turns its stored samples (of the class's
# stored_dtype) into network inputs and back to pixels. The one table that dataset_tool.py, shards and training
# read. A new encoding is an Encoder subclass (its `encoding` name, stored_dtype and the arguments it takes) and a
# row here.
ENCODINGS: dict[str, type[Encoder]] = {cls.encoding: cls for cls in (StandardRGBEncoder, StabilityVAEEncoder,
                                                                     DiffusersVAEEncoder, LinearRGBEncoder)}

# What a dataset that records no encoding (the release's, or ours before encodings were recorded) holds, by the
# dtype of its samples: the release's rule, PNG pixels or the Stability VAE's mean/std latents.
RELEASE_ENCODINGS: dict[str, type[Encoder]] = {PIXELS: StandardRGBEncoder, LATENTS: StabilityVAEEncoder}


def encoder_for_dataset(encoding: object, settings: object) -> Encoder:
    """The encoder of a dataset that records its encoding (dataset.json "encoding" and "encoding_settings");
    EncoderSettingsError, one line naming it, for an encoding this edm2 does not know or settings it cannot take."""
    registered(encoding)
    if not isinstance(settings, dict):
        raise EncoderSettingsError(f"encoding_settings of {encoding!r}: expected an object")
    try:
        return ENCODINGS[encoding](**settings)
    except (TypeError, ValueError) as e:
        raise EncoderSettingsError(f"encoding_settings of {encoding!r}: {one_line(e)}") from None


def registered(encoding: object) -> type[Encoder]:
    """The class ENCODINGS registers under the name encoding; EncoderSettingsError, one line, for one it lacks."""
    if not isinstance(encoding, str) or encoding not in ENCODINGS:
        shown = repr(encoding)[:60]
        raise EncoderSettingsError(f"the data encoding {shown} is not registered: this edm2 knows "
                                   f"{', '.join(ENCODINGS)} (edm2.encoders.ENCODINGS)")
    return ENCODINGS[encoding]


def encoder_from_config(config: dict) -> Encoder:
    """Rebuild an encoder from its config() dictionary."""
    settings = dict(config)
    kind = settings.pop("class", None)
    if kind == "StabilityVAEEncoder" and {"vae_name", "scale", "bias"} <= set(settings) <= _VAE_KEYS:
        try:
            return StabilityVAEEncoder.from_scale_bias(**settings)
        except (TypeError, ValueError) as e:  # numbers that are not numbers; EncoderSettingsError included
            raise EncoderSettingsError(f"not an encoder config: {config} ({one_line(e)})") from None
    classes = {cls.__name__: cls for cls in ENCODINGS.values()}
    if kind in classes and kind != "StabilityVAEEncoder":
        try:  # another encoding's config() is its class and the arguments its constructor takes
            return classes[kind](**settings)
        except (TypeError, ValueError) as e:
            raise EncoderSettingsError(f"not an encoder config: {config} ({one_line(e)})") from None
    raise EncoderSettingsError(f"not an encoder config: {config}")


def load_vae(vae_name: str):
    """diffusers AutoencoderKL from a hub name or local directory, in eval mode without gradients."""
    from diffusers import AutoencoderKL  # imported here: diffusers takes seconds to import

    path = Path(vae_name).expanduser()
    looks_local = path.is_absolute() or vae_name.startswith(".") or vae_name.count("/") > 1
    if looks_local and not path.is_dir():
        raise EncoderError(f"cannot load the VAE '{vae_name}': no such directory")
    # Without accelerate, diffusers warns on every load unless low-memory loading is turned off.
    options = {"low_cpu_mem_usage": importlib.util.find_spec("accelerate") is not None}
    try:
        try:
            vae = AutoencoderKL.from_pretrained(str(path) if path.is_dir() else vae_name, local_files_only=True,
                                                **options)
        except Exception:  # not in the local cache: ask the hub
            vae = AutoencoderKL.from_pretrained(vae_name, **options)
    except Exception as e:  # the hub raises many kinds (OSError, ValueError, HTTP errors)
        raise EncoderError(f"cannot load the VAE '{vae_name}' (hub name or local directory): "
                           f"{type(e).__name__}: {one_line(e)}") from None
    return vae.eval().requires_grad_(False)
