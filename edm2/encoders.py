"""Conversions between uint8 pixels and network inputs: RGB scaling, or Stability VAE latents.

Pixels are first encoded into "raw latents" (what a dataset stores), then into the normalized
"final latents" the network sees; decoding goes from final latents straight back to pixels.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from edm2.errors import EDM2Error, one_line

DEFAULT_VAE = "stabilityai/sd-vae-ft-mse"


class EncoderError(EDM2Error):
    """The VAE cannot be loaded, or an encoder cannot be built as asked; the message names what and why."""


class EncoderSettingsError(EncoderError, ValueError):
    """Settings that describe no encoder; also a ValueError, as which readers of stored settings catch it."""


class Encoder:
    """Common interface: encode = encode_latents(encode_pixels(x)); `encoding` is the name under which ENCODINGS
    registers the class and a dataset records what it holds (dataset.json "encoding")."""

    encoding = ""
    stores_pixels = False  # whether a dataset of this encoding stores PNG pixels (dataset_tool.py convert writes it)

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
        """JSON-serializable settings; encoder_from_config() rebuilds the encoder."""
        raise NotImplementedError

    def dataset_record(self) -> dict:
        """What a dataset of this encoding records in dataset.json: its name and the settings that rebuild it."""
        settings = self.settings()
        return {"encoding": self.encoding, **({"encoding_settings": settings} if settings else {})}

    def settings(self) -> dict:
        """The constructor arguments that a dataset records (encoder_for_dataset passes them back)."""
        return {}

    def init(self, device: torch.device) -> None:
        """Load now, onto device, what decoding needs (pixels need nothing), so that it fails before any sampling."""


class StandardRGBEncoder(Encoder):
    """RGB pixels scaled to [-1, 1] (release)."""

    encoding = "pixels"
    stores_pixels = True

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

    def config(self) -> dict:
        """No settings beyond the class."""
        return {"class": "StandardRGBEncoder"}


class StabilityVAEEncoder(Encoder):
    """Latents of a diffusers AutoencoderKL, normalized as in paper Appendix B.1 (sigma_data = 0.5).

    The VAE is loaded on first use, onto the device of the input, and is never pickled.
    """

    encoding = "stability-vae"

    def __init__(self, vae_name: str = DEFAULT_VAE,
                 raw_mean: Sequence[float] = (5.81, 3.25, 0.12, -2.15),
                 raw_std: Sequence[float] = (4.17, 4.62, 3.71, 3.28),
                 final_mean: float = 0.0, final_std: float = 0.5, batch_size: int = 8):
        # float32 arithmetic as in the release, so scale/bias equal the values its pickles store.
        scale = np.float32(final_std) / np.asarray(raw_std, dtype=np.float32)
        bias = np.float32(final_mean) - np.asarray(raw_mean, dtype=np.float32) * scale
        self._setup(vae_name, scale, bias, batch_size)

    @classmethod
    def from_scale_bias(cls, vae_name: str, scale: Sequence[float], bias: Sequence[float],
                        batch_size: int = 8) -> StabilityVAEEncoder:
        """Encoder with final = raw * scale + bias given directly (as the release's pickles store it)."""
        encoder = cls.__new__(cls)
        encoder._setup(vae_name, np.asarray(scale, dtype=np.float32), np.asarray(bias, dtype=np.float32),
                       batch_size)
        return encoder

    def _setup(self, vae_name: str, scale: np.ndarray, bias: np.ndarray, batch_size: int) -> None:
        if scale.shape != bias.shape or scale.ndim != 1:
            raise EncoderSettingsError(f"scale and bias must be equal-length vectors, got {scale.shape} and "
                                       f"{bias.shape}")
        if int(batch_size) < 1:
            raise EncoderSettingsError(f"batch_size must be positive, got {batch_size}")
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
            self._vae = load_vae(self.vae_name)
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
        return in_channels // 2

    def settings(self) -> dict:
        """The VAE whose latents a dataset holds; the normalization is the network's (config())."""
        return {"vae_name": self.vae_name}

    def config(self) -> dict:
        """VAE name, normalization and batch size; floats are the exact float32 values."""
        return {"class": "StabilityVAEEncoder", "vae_name": self.vae_name, "scale": self.scale.tolist(),
                "bias": self.bias.tolist(), "batch_size": self.batch_size}


class LinearRGBEncoder(Encoder):
    """sRGB pixels stored as they are, seen by the network in linear light, ((x / 255) ** gamma) * 2 - 1: the
    README's worked example of a data encoding (Extending)."""

    encoding = "linear-rgb"
    stores_pixels = True

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

    def config(self) -> dict:
        """The class and gamma (encoder_from_config)."""
        return {"class": "LinearRGBEncoder", "gamma": self.gamma}

    def settings(self) -> dict:
        """gamma, which a dataset records."""
        return {"gamma": self.gamma}


_VAE_KEYS = {"vae_name", "scale", "bias", "batch_size"}

# The data encodings a dataset may hold, by the name dataset.json records ("encoding", with its constructor's
# arguments as "encoding_settings" if any): what turns its stored samples into network inputs and back to pixels.
# A new encoding is an Encoder subclass (its `encoding` name, config() and the arguments it takes) and a row here.
ENCODINGS: dict[str, type[Encoder]] = {cls.encoding: cls for cls in (StandardRGBEncoder, StabilityVAEEncoder,
                                                                     LinearRGBEncoder)}


def encoder_for_dataset(encoding: object, settings: object) -> Encoder:
    """The encoder of a dataset that records its encoding (dataset.json "encoding" and "encoding_settings");
    EncoderSettingsError, one line naming it, for an encoding this edm2 does not know or settings it cannot take."""
    if not isinstance(encoding, str) or encoding not in ENCODINGS:
        shown = repr(encoding)[:60]
        raise EncoderSettingsError(f"the data encoding {shown} is not registered: this edm2 knows "
                                   f"{', '.join(ENCODINGS)} (edm2.encoders.ENCODINGS)")
    if not isinstance(settings, dict):
        raise EncoderSettingsError(f"encoding_settings of {encoding!r}: expected an object")
    try:
        return ENCODINGS[encoding](**settings)
    except (TypeError, ValueError) as e:
        raise EncoderSettingsError(f"encoding_settings of {encoding!r}: {one_line(e)}") from None


def encoder_from_config(config: dict) -> Encoder:
    """Rebuild an encoder from its config() dictionary."""
    settings = dict(config)
    kind = settings.pop("class", None)
    if kind == "StandardRGBEncoder" and not settings:
        return StandardRGBEncoder()
    if kind == "StabilityVAEEncoder" and {"vae_name", "scale", "bias"} <= set(settings) <= _VAE_KEYS:
        try:
            return StabilityVAEEncoder.from_scale_bias(**settings)
        except (TypeError, ValueError) as e:  # numbers that are not numbers; EncoderSettingsError included
            raise EncoderSettingsError(f"not an encoder config: {config} ({one_line(e)})") from None
    registered = {cls.__name__: cls for cls in ENCODINGS.values()}
    if kind in registered and registered[kind] not in (StandardRGBEncoder, StabilityVAEEncoder):
        try:  # another encoding's config() is its class and the settings its constructor takes
            return registered[kind](**settings)
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
