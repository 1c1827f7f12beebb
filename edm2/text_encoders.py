"""Text encoders for captions: a transformers T5 encoder or CLIP text model, run in float32 at a fixed token length,
giving each caption's pooled and per-token embeddings (edm2.text_condition packs them into its condition).

transformers is an optional extra (pip install edm2[text]), imported when an encoder is loaded, never at import.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from edm2.errors import EDM2Error, one_line, shown
from edm2.text_condition import pack_condition

MAX_TOKENS = 4096  # far past T5's 512 and CLIP's 77: a record asking for more is no text encoding of ours
MAX_TEXT_DIM = 1 << 14  # T5-XXL has 4096 features
STORED_DTYPE = np.float16  # cached embeddings: 2 bytes per value (docs/text.md)
# Default token lengths: CLIP's context, and the 128 T5 tokens NeMo's Imagen caches.
DEFAULT_TOKENS = {"t5": 128, "clip": 77}
# transformers' model_type of each family's configs; a full T5 or CLIP checkpoint loads as its text encoder.
MODEL_TYPES = {"t5": "t5", "mt5": "t5", "umt5": "t5", "clip": "clip", "clip_text_model": "clip"}
POOLED = {"t5": "mean of the real tokens' last hidden states (attention mask)",
          "clip": "CLIP's pooler output (the last hidden state at the end-of-text token)"}
_HASH_CHUNK = 1 << 20


class TextEncoderError(EDM2Error):
    """A text encoder that cannot be loaded or used: transformers missing, a folder it cannot load, wrong settings."""


class TokenLengthError(TextEncoderError):
    """A token length the encoder cannot take."""


class TextEncoderMismatchError(TextEncoderError):
    """A dataset's or snapshot's recorded text encoder is not the one given."""


def _transformers():
    try:
        import transformers
    except ImportError:
        raise TextEncoderError("text encoders need transformers, an optional extra: pip install edm2[text]") from None
    return transformers


def folder_sha256(folder: Path) -> str:
    """SHA-256 over a model folder's files sorted by relative path (each one's path, size and bytes; hidden files
    such as a hub download's .cache/ left out), so that equal weights and tokenizers give equal identities."""
    digest = hashlib.sha256()
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    for name in names:
        path = folder / name
        digest.update(name.encode() + b"\0" + path.stat().st_size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def _model_folder(name: str) -> Path:
    """The local folder of a model: the given folder, or the hub cache's snapshot that loading just filled."""
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, local_files_only=True))


class TextEncoder:
    """A loaded T5 encoder or CLIP text model and its tokenizer, at `tokens` (L) tokens of `dim` (D) features."""

    def __init__(self, name: str, family: str, model: torch.nn.Module, tokenizer, tokens: int, sha256: str,
                 device: torch.device):
        self.name, self.family, self.model, self.tokenizer = name, family, model, tokenizer
        self.tokens, self.device, self.sha256 = tokens, device, sha256
        self.dim = int(model.config.hidden_size if family == "clip" else model.config.d_model)

    @property
    def identity(self) -> dict:
        """{name, class, sha256}: what a dataset records of its encoder, so generation can check it uses the same."""
        return {"name": self.name, "class": type(self.model).__name__, "sha256": self.sha256}

    def record(self) -> dict:
        """dataset.json's "text_encoding" record of embeddings made by this encoder."""
        return {"encoder": self.identity, "tokens": self.tokens, "dim": self.dim, "pooled": POOLED[self.family]}

    def token_counts(self, captions: Sequence[str]) -> np.ndarray:
        """Tokens of each caption before truncation (special tokens included); more than `tokens` are cut."""
        ids = self.tokenizer(list(captions), truncation=False, verbose=False)["input_ids"]
        return np.array([len(i) for i in ids], dtype=np.int64)

    @torch.no_grad()
    def encode(self, captions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pooled [N, D], tokens [N, L, D] zero past each caption's length, lengths [N]) in float32 on the CPU; a
        caption longer than L tokens is truncated to L (its end-of-text token kept, as the tokenizer truncates)."""
        batch = self.tokenizer(list(captions), padding="max_length", truncation=True, max_length=self.tokens,
                               return_tensors="pt")
        ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        out = self.model(input_ids=ids, attention_mask=mask)
        hidden = out.last_hidden_state.float()
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        tokens = hidden * weights
        if self.family == "clip":
            pooled = out.pooler_output.float()
        else:
            pooled = tokens.sum(dim=1) / weights.sum(dim=1).clamp(min=1)
        return pooled.cpu(), tokens.cpu(), mask.sum(dim=1).cpu()


def load_text_encoder(id_or_dir: str | os.PathLike, tokens: int | None = None,
                      device: torch.device | str = "cpu") -> TextEncoder:
    """A T5 encoder or CLIP text model from a folder saved by save_pretrained (or a hub ID, which transformers may
    download into its own cache), at `tokens` tokens (default DEFAULT_TOKENS of its family); one-line errors."""
    transformers = _transformers()
    name = str(id_or_dir)
    try:
        config = transformers.AutoConfig.from_pretrained(name)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TextEncoderError(f"{shown(name)}: transformers cannot load a text encoder from it ({one_line(e)})") from None
    family = MODEL_TYPES.get(config.model_type)
    if family is None:
        raise TextEncoderError(f"{shown(name)} holds a {shown(config.model_type)} model; text encoders are T5 "
                               f"encoders or CLIP text models")
    tokens = DEFAULT_TOKENS[family] if tokens is None else tokens
    limit = MAX_TOKENS
    if family == "clip":
        text_config = getattr(config, "text_config", config)
        limit = min(limit, int(text_config.max_position_embeddings))
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 1 <= tokens <= limit:
        raise TokenLengthError(f"tokens={tokens!r}: {shown(name)} takes 1 to {limit} tokens")
    model_class = transformers.CLIPTextModel if family == "clip" else transformers.T5EncoderModel
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        model = model_class.from_pretrained(name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise TextEncoderError(f"{shown(name)}: transformers cannot load a text encoder from it ({one_line(e)})") from None
    if tokenizer.pad_token_id is None:
        raise TextEncoderError(f"{shown(name)}: its tokenizer has no padding token")
    device = torch.device(device)
    sha256 = folder_sha256(_model_folder(name))
    return TextEncoder(name, family, model.eval().requires_grad_(False).to(device), tokenizer, tokens, sha256, device)


def stored_embeddings(pooled: torch.Tensor, tokens: torch.Tensor) -> np.ndarray:
    """The cached form of encode's output: float16 [N, 1 + L, D], row 0 pooled, rows 1..L the tokens; values past
    float16's range are refused rather than stored as infinities."""
    values = torch.cat([pooled.unsqueeze(1), tokens], dim=1).numpy()
    if not (np.abs(values) <= np.finfo(STORED_DTYPE).max).all():  # NaN fails the comparison too
        raise TextEncoderError("the text encoder's embeddings exceed float16's range (65504) or are not finite")
    return values.astype(STORED_DTYPE)


def condition_of(embeddings: np.ndarray, length: int) -> np.ndarray:
    """The float32 condition [1 + L, D + 1] (edm2.text_condition) of one caption's stored embeddings [1 + L, D]."""
    values = torch.from_numpy(np.asarray(embeddings, dtype=np.float32))
    return pack_condition(values[0], values[1:], length).numpy()


class OnlineConditions:
    """Captions -> conditions with a loaded encoder during training, rounded through float16 as the cache stores
    them, so that online and cached encoding train on the same conditions."""

    def __init__(self, encoder: TextEncoder):
        self.encoder = encoder

    def __call__(self, captions: Sequence[str]) -> torch.Tensor:
        """Float32 conditions [N, 1 + L, D + 1] of the captions."""
        pooled, tokens, lengths = self.encoder.encode(captions)
        stored = torch.from_numpy(stored_embeddings(pooled, tokens)).float()
        return pack_condition(stored[:, 0], stored[:, 1:], lengths)

    def empty_condition(self) -> torch.Tensor:
        """The empty caption's condition [1 + L, D + 1] (text dropout, guidance's unconditional branch)."""
        return self([""])[0]


def check_encoder_matches(record: dict, encoder: TextEncoder) -> None:
    """Refuse an encoder other than the one a dataset's or snapshot's "text_encoding" record names (its class and
    files' SHA-256), or one at another token length or width; the message says what differs."""
    recorded = record.get("encoder", {}) if isinstance(record, dict) else {}
    recorded = recorded if isinstance(recorded, dict) else {}
    expected = {"class": recorded.get("class"), "sha256": recorded.get("sha256"), "tokens": record.get("tokens"),
                "dim": record.get("dim")}
    given = {"class": encoder.identity["class"], "sha256": encoder.sha256, "tokens": encoder.tokens,
             "dim": encoder.dim}
    differ = [f"{key} {shown(expected[key])} != {shown(given[key])}" for key in expected if expected[key] != given[key]]
    if differ:
        raise TextEncoderMismatchError(f"the text encoder {shown(encoder.name)} is not the one recorded "
                                       f"({shown(recorded.get('name'))}): {'; '.join(differ)}")
