"""Feature detectors for FID (Inception-v3) and FD_DINOv2 (DINOv2 ViT-L/14), each loaded from one published file.

FID and FD_DINOv2 are defined by two published files: StyleGAN2-ADA's TorchScript Inception (a program, run as it
is) and DINOv2's ViT-L/14 state dict (weights for our own network). A file is loaded only if its SHA-256 is the
published one (edm2/runtime/pinned_files.py); every other file, whatever it holds, is refused before anything parses it.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import re
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from edm2.errors import EDM2Error, one_line
from edm2.runtime import files, pinned_files

INCEPTION_URL = "https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/inception-2015-12-05.pt"
DINOV2_URL = "https://dl.fbaipublicfiles.com/dinov2/dinov2_vitl14/dinov2_vitl14_pretrain.pth"

# dgm-eval protocol for FD_DINOv2 (paper Appendix A.5): 224x224 input, ImageNet normalization.
DINOV2_RESOLUTION = 224
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class DetectorError(EDM2Error):
    """A detector's weights are missing or are not what the detector expects; the message names the file."""


@dataclasses.dataclass(frozen=True)
class PublishedFile:
    """A detector's published weights: where they are downloaded from, what they are, the SHA-256 of their bytes."""

    url: str
    what: str
    sha256: str


# Metric -> the one file its detector loads. The digests are the ones other projects pin for these URLs:
# the Inception file's in k-diffusion (crowsonkb/k-diffusion, k_diffusion/evaluation.py; 95,607,719 bytes),
# DINOv2's in refiners' DINOv2 conversion (finegrain-ai/refiners; 1,217,586,395 bytes).
PUBLISHED = {
    "fid": PublishedFile(INCEPTION_URL, "Inception-v3 TorchScript file",
                         "f58cb9b6ec323ed63459aa4fb441fe750cfe39fafad6da5cb504a16f19e958f4"),
    "fd_dinov2": PublishedFile(DINOV2_URL, "DINOv2 ViT-L/14 weights",
                               "d5383ea8f4877b2472eb973e0fd72d557c7da5d3611bd527ceeb1d7162cbf428"),
}


def default_weights_path(url: str) -> Path:
    """Where a detector's published file is looked for before any download, and downloaded to:
    $EDM2_CACHE_DIR/detectors/ (default ~/.cache/edm2/detectors/) under the URL's file name.

    Clusters without internet copy the files there (or pass their paths to the detectors).
    """
    return files.cache_dir() / "detectors" / os.path.basename(url)


def _default_weights(url: str, dest: Path | None = None) -> Path:
    """The published file of a detector: found at dest (default: default_weights_path(url)), else downloaded
    there; a failed download says where to put the file by hand."""
    dest = default_weights_path(url) if dest is None else dest
    if dest.is_file():
        return dest
    earlier = files.download_cache_path(url)  # where versions before the detectors/ folder downloaded it
    if earlier.is_file():
        return earlier
    try:
        return files.download(url, dest)
    except files.DownloadError as e:
        raise DetectorError(f"{e}; without internet, download {url} elsewhere and copy it to {dest} "
                            "(or give the path of the file)") from None


def _local_weights(path_or_url: str | os.PathLike | None, url: str, default: Path | None = None) -> tuple[Path, str]:
    """(local path, name for messages) of detector weights: the given file or URL (downloaded once into the
    cache; named as given), or with None the published file at `url` (kept at `default`, else see
    default_weights_path; named by its local path); raises DetectorError if absent."""
    path = _default_weights(url, default) if path_or_url is None else files.cached_path(path_or_url)
    name = str(path if path_or_url is None else path_or_url)
    if not path.is_file():
        raise DetectorError(f"detector weights not found: {name}")
    return path, name


def published_bytes(metric: str, path_or_url: str | os.PathLike | None = None) -> tuple[bytes, str]:
    """(bytes, name for messages) of a metric's published detector file, found as _local_weights finds it and
    verified by its SHA-256 (PUBLISHED) before anything parses it; any other file raises DetectorError."""
    return verified_bytes(PUBLISHED[metric], path_or_url)


def verified_bytes(published: PublishedFile, path_or_url: str | os.PathLike | None = None,
                   default: Path | None = None) -> tuple[bytes, str]:
    """(bytes, name for messages) of a published file, the given copy or (None) the one kept at `default` or
    downloaded there, verified by its SHA-256 before anything parses it; any other file raises DetectorError, and
    so does every file while the published digest is unknown (sha256 empty)."""
    if not published.sha256:
        raise DetectorError(f"the SHA-256 of the published {published.what} ({published.url}) is not pinned in "
                            "this version, so no copy of it can be verified; it is refused")
    path, name = _local_weights(path_or_url, published.url, default)
    try:
        return pinned_files.read_pinned(path, published.sha256), name
    except OSError as e:
        raise DetectorError(f"cannot read {name}: {e.strerror or e}") from None
    except pinned_files.PinnedFileError as e:
        if path.resolve().is_relative_to(files.cache_dir().resolve()):
            advice = f"delete {path} (a damaged or tampered download) and run again to download it anew"
        else:
            advice = f"only the published file is accepted: {published.url}"
        raise DetectorError(f"{name} is not the published {published.what}: {e}; {advice}") from None


class InceptionV3:
    """FID features: 2048-d pool3 of the TF Inception-v3 (2015-12-05) graph, in its published TorchScript form."""

    def __init__(self, path_or_url: str | os.PathLike | None = None, device: torch.device | str = "cpu"):
        data, name = published_bytes("fid", path_or_url)
        try:
            self.model = torch.jit.load(io.BytesIO(data), map_location=device).eval()
        except (RuntimeError, ValueError, OSError) as e:
            raise DetectorError(f"{name} is not a TorchScript Inception file: {one_line(e)}") from None
        self.device = torch.device(device)
        # The TorchScript file fixes the width; one tiny probe reads it (the network resizes any input itself).
        self.feature_dim = self(torch.zeros([1, 3, 16, 16], dtype=torch.uint8, device=self.device)).shape[1]

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW RGB images of any size -> float32 features [N, feature_dim]."""
        return self.model(images, return_features=True).to(torch.float32)


class _Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (DINOv2 layout: [3, heads, head_dim] per token)."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, width * 3)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, tokens, width = x.shape
        q, k, v = self.qkv(x).reshape(n, tokens, 3, self.num_heads, width // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(n, tokens, width))


class _LayerScale(nn.Module):
    """Learned per-channel residual gain."""

    def __init__(self, width: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class _Mlp(nn.Module):
    """Two-layer feed-forward network with exact GELU."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _Block(nn.Module):
    """Pre-norm transformer block with LayerScale on both residual branches."""

    def __init__(self, width: int, num_heads: int, mlp_width: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.attn = _Attention(width, num_heads)
        self.ls1 = _LayerScale(width)
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = _Mlp(width, mlp_width)
        self.ls2 = _LayerScale(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class _PatchEmbed(nn.Module):
    """Non-overlapping patches -> tokens."""

    def __init__(self, in_channels: int, width: int, patch_size: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, width, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class DINOv2ViT(nn.Module):
    """DINOv2 vision transformer (defaults: ViT-L/14); parameter names equal the official checkpoint's."""

    HEAD_DIM = 64  # every published DINOv2 backbone uses 64 channels per attention head

    def __init__(self, patch_size: int = 14, grid: int = 37, width: int = 1024, depth: int = 24,
                 num_heads: int = 16, mlp_width: int = 4096, in_channels: int = 3):
        super().__init__()
        self.patch_size = patch_size
        self.grid = grid
        self.width = width
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + grid * grid, width))
        # Used only by masked-image training; kept so the official state dict loads strictly.
        self.mask_token = nn.Parameter(torch.zeros(1, width))
        self.patch_embed = _PatchEmbed(in_channels, width, patch_size)
        self.blocks = nn.ModuleList([_Block(width, num_heads, mlp_width) for _ in range(depth)])
        self.norm = nn.LayerNorm(width, eps=1e-6)

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> DINOv2ViT:
        """Build the network whose shapes the state dict implies and load it strictly."""
        try:
            width = state["cls_token"].shape[-1]
            out_width, in_channels, patch_size, _ = state["patch_embed.proj.weight"].shape
            kwargs = dict(
                patch_size=patch_size, grid=math.isqrt(state["pos_embed"].shape[1] - 1), width=width,
                depth=len({key.split(".")[1] for key in state if key.startswith("blocks.")}),
                num_heads=width // cls.HEAD_DIM, mlp_width=state["blocks.0.mlp.fc1.weight"].shape[0],
                in_channels=in_channels)
        except (KeyError, AttributeError, ValueError, TypeError) as e:
            raise DetectorError(f"not a DINOv2 ViT state dict (missing or malformed {e})") from None
        if width <= 0 or width % cls.HEAD_DIM:
            raise DetectorError(f"width {width} is not a multiple of {cls.HEAD_DIM} (whole attention heads)")
        with torch.device("meta"):
            net = cls(**kwargs)
        try:
            net.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:
            raise DetectorError(f"state dict does not match the DINOv2 ViT layout: {e}") from None
        return net.eval().requires_grad_(False)

    def position_embedding(self, rows: int, cols: int) -> torch.Tensor:
        """Class + patch position embeddings for a rows x cols patch grid (bicubic resampling of the learned grid)."""
        if rows == cols == self.grid:
            return self.pos_embed
        patch = self.pos_embed[:, 1:].float().reshape(1, self.grid, self.grid, self.width).permute(0, 3, 1, 2)
        # DINOv2 resamples with scale factor (n + 0.1) / grid rather than to size n; the sample positions
        # (and thus the features) depend on it, so we do the same.
        scale = ((rows + 0.1) / self.grid, (cols + 0.1) / self.grid)
        patch = F.interpolate(patch, scale_factor=scale, mode="bicubic")
        patch = patch.permute(0, 2, 3, 1).reshape(1, rows * cols, self.width).to(self.pos_embed.dtype)
        return torch.cat([self.pos_embed[:, :1], patch], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalized float images [N, C, H, W] -> final-norm class token [N, width]."""
        rows, cols = x.shape[2] // self.patch_size, x.shape[3] // self.patch_size
        tokens = self.patch_embed(x)
        tokens = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), tokens], dim=1)
        tokens = tokens + self.position_embedding(rows, cols)
        for block in self.blocks:
            tokens = block(tokens)
        return self.norm(tokens[:, 0])  # LayerNorm acts per token, so normalizing the class token alone suffices


class DINOv2:
    """FD_DINOv2 features: DINOv2 ViT class token after 224x224 bicubic antialiased resize and ImageNet normalization."""

    def __init__(self, path_or_url: str | os.PathLike | None = None, device: torch.device | str = "cpu"):
        # The verified bytes are parsed from memory: nothing can swap or rewrite the file between the check and
        # the load. The cost is a transient second copy of the 1.2 GB while torch builds the tensors from it; a
        # private temporary copy would cost as much disk instead, and a full /tmp would be one more way to fail.
        data, name = published_bytes("fd_dinov2", path_or_url)
        try:
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # weights_only refuses; its message spans lines and invites a retry
            named = re.search(r"GLOBAL ([\w.]+)", str(e))
            detail = f"it names {named[1]}" if named else "it holds objects other than tensors"
            raise DetectorError(f"{name} is not a plain PyTorch state dict: {detail}") from None
        # KeyError: what torch.load raises for bytes it takes for its legacy format (a cut-off download).
        except (RuntimeError, ValueError, EOFError, KeyError) as e:
            raise DetectorError(f"{name} is not a plain PyTorch state dict: {one_line(e)}") from None
        del data  # the raw copy is not needed once the tensors exist
        if not isinstance(state, dict):
            raise DetectorError(f"{name} does not hold a state dict")
        try:
            self.model = DINOv2ViT.from_state_dict(state).to(device)
        except DetectorError as e:
            raise DetectorError(f"{name}: {e}") from None
        self.device = torch.device(device)
        self.feature_dim = self.model.width
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device).reshape(1, -1, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=self.device).reshape(1, -1, 1, 1)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW RGB images of any size -> float32 class-token features [N, feature_dim]."""
        x = images.to(torch.float32)
        x = F.interpolate(x, size=(DINOV2_RESOLUTION, DINOV2_RESOLUTION), mode="bicubic", antialias=True)
        x = (x / 255 - self.mean) / self.std
        return self.model(x).to(torch.float32)


# Metric name -> detector class (PUBLISHED holds the file each loads).
DETECTORS: dict[str, Callable[..., InceptionV3 | DINOv2]] = {"fid": InceptionV3, "fd_dinov2": DINOv2}


def load_detector(metric: str, path_or_url: str | os.PathLike | None = None,
                  device: torch.device | str = "cpu") -> InceptionV3 | DINOv2:
    """The feature detector of a metric ('fid' or 'fd_dinov2'), from its published file (None; see
    default_weights_path) or the given copy of it (path or URL); any file but the published one is refused."""
    return DETECTORS[metric](path_or_url, device=device)
