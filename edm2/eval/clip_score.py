"""CLIP score (Hessel et al. 2021, as NeMo reports text-to-image models): 100 * max(cos(E_I(image), E_T(prompt)), 0)
per image, averaged over the images, with OpenAI's CLIP ViT-L/14 in its transformers form (CLIPModel).

The detector is three published files of the Hugging Face repository openai/clip-vit-large-patch14: the weights
(model.safetensors), and the tokenizer's vocab.json and merges.txt. Each is loaded only if its SHA-256 is the
published one, verified before anything parses it (edm2.eval.detectors.verified_bytes); the architecture is
pinned here, not read from a file. transformers (the `text` extra) is imported only when the detector is built.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F

from edm2.errors import one_line
from edm2.eval.detectors import DetectorError, PublishedFile, verified_bytes
from edm2.runtime import bounded_json, distributed, files

CLIP_REPOSITORY = "https://huggingface.co/openai/clip-vit-large-patch14/resolve/main/"
# CLIP's own preprocessing (its CLIPImageProcessor): shorter side to 224 by bicubic, centre crop, its mean and std.
CLIP_RESOLUTION = 224
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CLIP_CONTEXT = 77  # CLIP's text positions: longer prompts are cut to their first 77 tokens, start and end included

# model.safetensors (1,710,540,580 bytes): the Git LFS object id Hugging Face shows for it, which is its SHA-256,
# the same in every copy of the repository we checked.
CLIP_WEIGHTS_SHA256 = "a2bf730a0c7debf160f7a6b50b3aaf3703e7e88ac73de7a314903141db026dcb"
# vocab.json and merges.txt are plain Git files, for which Hugging Face shows no SHA-256, and no source we could
# check gives one: empty, so the CLIP score refuses to run until their digests are pinned here.
CLIP_VOCAB_SHA256 = ""
CLIP_MERGES_SHA256 = ""
MAX_SCORE = 100.0


@dataclasses.dataclass(frozen=True)
class ClipRelease:
    """A CLIP model's architecture (CLIPConfig's arguments) and its three published files."""

    architecture: dict
    weights: PublishedFile
    vocab: PublishedFile
    merges: PublishedFile

    def files(self) -> dict[str, PublishedFile]:
        """File name in the model's folder -> the published file."""
        return {"model.safetensors": self.weights, "vocab.json": self.vocab, "merges.txt": self.merges}


# openai/clip-vit-large-patch14: ViT-L/14 at 224 and the 12-layer text transformer, both with quick GELU, into 768-d.
VIT_L14 = ClipRelease(
    architecture=dict(
        vision_config=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24,
                           image_size=CLIP_RESOLUTION, patch_size=14, hidden_act="quick_gelu", layer_norm_eps=1e-5),
        text_config=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                         max_position_embeddings=CLIP_CONTEXT, vocab_size=49408, hidden_act="quick_gelu",
                         layer_norm_eps=1e-5, bos_token_id=49406, eos_token_id=49407, pad_token_id=49407),
        projection_dim=768),
    weights=PublishedFile(CLIP_REPOSITORY + "model.safetensors", "CLIP ViT-L/14 weights", CLIP_WEIGHTS_SHA256),
    vocab=PublishedFile(CLIP_REPOSITORY + "vocab.json", "CLIP ViT-L/14 tokenizer vocabulary", CLIP_VOCAB_SHA256),
    merges=PublishedFile(CLIP_REPOSITORY + "merges.txt", "CLIP ViT-L/14 tokenizer merges", CLIP_MERGES_SHA256),
)


def default_clip_folder() -> Path:
    """Where the CLIP files are looked for before any download, and downloaded to:
    $EDM2_CACHE_DIR/detectors/clip-vit-large-patch14/ (a copy of the repository's folder works as it is)."""
    return files.cache_dir() / "detectors" / "clip-vit-large-patch14"


def _import_transformers():
    """transformers, or one line saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise DetectorError("the CLIP score needs transformers: pip install edm2[text]") from None
    return transformers


def _release_file(release: ClipRelease, name: str, folder: str | os.PathLike | None) -> tuple[bytes, str]:
    """The verified bytes of one of the release's files, from `folder` or the default folder (downloaded there)."""
    published = release.files()[name]
    if folder is None:
        return verified_bytes(published, None, default_clip_folder() / name)
    path = Path(folder) / name
    if not path.is_file():
        raise DetectorError(f"{folder} has no {name}; the CLIP folder holds model.safetensors, vocab.json and "
                            "merges.txt of openai/clip-vit-large-patch14")
    return verified_bytes(published, path)


def _parse_tokenizer(vocab_bytes: bytes, merges_bytes: bytes, names: tuple[str, str]) -> tuple[dict, list]:
    """(token -> id, merge pairs) of CLIP's byte-level BPE files; malformed files name themselves."""
    try:
        vocab = bounded_json.parse(vocab_bytes, names[0])
    except bounded_json.JSONFileError as e:
        raise DetectorError(f"{names[0]} is not a JSON vocabulary: {one_line(e)}") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise DetectorError(f"{names[0]} is not a vocabulary (an object of token -> id)")
    try:
        lines = merges_bytes.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DetectorError(f"{names[1]} is not UTF-8 text: {one_line(e)}") from None
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    if not all(len(pair) == 2 for pair in merges):
        raise DetectorError(f"{names[1]} is not a list of BPE merges (two tokens a line)")
    return vocab, merges


class ClipScore:
    """The CLIP score of images and their prompts: 100 * max(cos, 0) of CLIP's image and text embeddings."""

    def __init__(self, folder: str | os.PathLike | None = None, device: torch.device | str = "cpu",
                 release: ClipRelease | None = None):
        release = VIT_L14 if release is None else release
        transformers = _import_transformers()
        # The small tokenizer files first: a refusal comes before 1.7 GB of weights are read.
        vocab_bytes, vocab_name = _release_file(release, "vocab.json", folder)
        merges_bytes, merges_name = _release_file(release, "merges.txt", folder)
        vocab, merges = _parse_tokenizer(vocab_bytes, merges_bytes, (vocab_name, merges_name))
        self.tokenizer = transformers.CLIPTokenizer(vocab=vocab, merges=merges)
        weights, weights_name = _release_file(release, "model.safetensors", folder)
        self.model = self._model(transformers, release, weights, weights_name).to(device)
        self.device = torch.device(device)
        self.resolution = release.architecture["vision_config"]["image_size"]
        self.context = release.architecture["text_config"]["max_position_embeddings"]
        self.mean = torch.tensor(CLIP_MEAN, device=self.device).reshape(1, -1, 1, 1)
        self.std = torch.tensor(CLIP_STD, device=self.device).reshape(1, -1, 1, 1)

    @staticmethod
    def _model(transformers, release: ClipRelease, weights: bytes, name: str) -> torch.nn.Module:
        """CLIPModel of the pinned architecture holding every tensor of the verified weights (parsed from memory)."""
        import safetensors
        import safetensors.torch

        try:
            state = safetensors.torch.load(weights)
        except safetensors.SafetensorError as e:
            raise DetectorError(f"{name} is not a safetensors file: {one_line(e)}") from None
        # Older exports carry position_ids, a buffer transformers now rebuilds itself.
        state = {key: value for key, value in state.items() if not key.endswith("embeddings.position_ids")}
        config = transformers.CLIPConfig(**release.architecture)
        # Quiet while loading (no per-tensor progress bar on every rank), then as the caller had it.
        verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        try:
            model, info = transformers.CLIPModel.from_pretrained(None, config=config, state_dict=state,
                                                                 output_loading_info=True)
        except (RuntimeError, ValueError) as e:
            raise DetectorError(f"{name} does not fit the CLIP architecture: {one_line(e)}") from None
        finally:
            transformers.logging.set_verbosity(verbosity)
            if bars:
                transformers.logging.enable_progress_bar()
        # transformers would fill missing tensors with random ones: a score from them would be meaningless.
        wrong = [*info.get("missing_keys", []), *info.get("unexpected_keys", []),
                 *(str(m[0]) for m in info.get("mismatched_keys", []))]
        if wrong:
            raise DetectorError(f"{name} does not match the CLIP architecture: {', '.join(sorted(wrong)[:3])} "
                                f"({len(wrong)} tensors missing, extra or of another shape)")
        return model.eval().requires_grad_(False)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW RGB (or grayscale) images -> CLIP's input: shorter side to the resolution by PIL's bicubic
        filter (as CLIP's own preprocessing resizes), centre crop, CLIP's mean and std."""
        if images.shape[1] == 1:
            images = images.expand(-1, 3, -1, -1)
        height, width = images.shape[2:]
        scale = self.resolution / min(height, width)
        size = (max(self.resolution, int(width * scale)), max(self.resolution, int(height * scale)))
        left, top = (size[0] - self.resolution) // 2, (size[1] - self.resolution) // 2
        box = (left, top, left + self.resolution, top + self.resolution)
        crops = [np.asarray(PIL.Image.fromarray(image).resize(size, PIL.Image.BICUBIC).crop(box))
                 for image in images.permute(0, 2, 3, 1).cpu().numpy()]
        x = torch.from_numpy(np.stack(crops)).to(self.device).permute(0, 3, 1, 2).to(torch.float32)
        return (x / 255 - self.mean) / self.std

    @torch.no_grad()
    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """Unit-length CLIP image embeddings [N, projection_dim] of uint8 images."""
        pooled = self.model.vision_model(pixel_values=self.preprocess(images)).pooler_output
        return F.normalize(self.model.visual_projection(pooled).to(torch.float32), dim=-1)

    @torch.no_grad()
    def text_embeddings(self, prompts: Sequence[str]) -> torch.Tensor:
        """Unit-length CLIP text embeddings [N, projection_dim] of prompts (cut to CLIP's context)."""
        tokens = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=self.context,
                                return_tensors="pt")
        pooled = self.model.text_model(input_ids=tokens["input_ids"].to(self.device),
                                       attention_mask=tokens["attention_mask"].to(self.device)).pooler_output
        return F.normalize(self.model.text_projection(pooled).to(torch.float32), dim=-1)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """Each image's CLIP score against its prompt, float32 [N] in [0, 100]."""
        if len(prompts) != images.shape[0]:
            raise DetectorError(f"{images.shape[0]} images but {len(prompts)} prompts; the CLIP score pairs them")
        cosine = (self.image_embeddings(images) * self.text_embeddings(prompts)).sum(-1)
        return MAX_SCORE * cosine.clamp(min=0)


class ScoreMean:
    """A running sum and count of per-image scores, summed across ranks at the end."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.total = torch.zeros([2], dtype=torch.float64, device=device)

    def add(self, scores: torch.Tensor) -> None:
        """Accumulate a batch of per-image scores."""
        self.total += torch.stack([scores.to(self.total).sum(), self.total.new_tensor(scores.numel())])

    def finalize(self) -> tuple[float, int]:
        """(mean score, number of images) over all ranks; every rank must call it."""
        total, count = distributed.all_reduce_sum(self.total.clone()).tolist()
        if count == 0:
            raise DetectorError("no images were scored")
        return total / count, int(count)
