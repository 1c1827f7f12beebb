"""Prompts for a text-to-image network: the text encoder its snapshot records (the one its training data's
embeddings came from), checked, and the conditions of a batch's prompts. Seed s gets prompts[s % len(prompts)]
(prompt_of_seed), in generate.py as in the FID-CLIP curve; prompts files are read by read_prompts."""

from __future__ import annotations

import os
from typing import Sequence

import torch

from edm2.errors import EDM2Error, shown
from edm2.runtime import files
from edm2.text_encoders import OnlineConditions, TextEncoder, check_encoder_matches, load_text_encoder


MAX_PROMPTS_BYTES = 1 << 28  # 256 MiB: COCO-2014's 30k captions are about 1.6 MB


class PromptsError(EDM2Error):
    """A prompts file cannot be read or holds no prompt; the message names the file."""


def read_prompts(path: str | os.PathLike) -> list[str]:
    """The prompts of a UTF-8 text file, one a line (surrounding spaces removed, blank lines skipped)."""
    try:
        with files.open_input(path) as file:
            size = os.fstat(file.fileno()).st_size
            if size > MAX_PROMPTS_BYTES:
                raise PromptsError(f"{path} is {size} bytes; a prompts file holds at most {MAX_PROMPTS_BYTES}")
            data = file.read(MAX_PROMPTS_BYTES + 1)
    except OSError as e:
        raise PromptsError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptsError(f"{path} is not UTF-8 text (byte {e.start}); write one prompt a line") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise PromptsError(f"{path} holds no prompt; write one prompt a line")
    return prompts


def prompt_index(seed: int, count: int) -> int:
    """The number of the prompt, among count, of the image of seed `seed`: seed % count."""
    return seed % count


def prompt_of_seed(prompts: Sequence[str], seed: int) -> str:
    """The prompt of the image of seed `seed`: prompts[prompt_index(seed, len(prompts))]."""
    return prompts[prompt_index(seed, len(prompts))]


class PromptError(EDM2Error):
    """Prompts that cannot be used with a network: a network without text conditioning, no text encoder given."""


def text_record(metadata: dict) -> dict | None:
    """The "text_encoding" record of a snapshot's training data (its metadata's dataset), None for a network that
    takes no text."""
    dataset = metadata.get("dataset") if isinstance(metadata, dict) else None
    record = dataset.get("text_encoding") if isinstance(dataset, dict) else None
    return record if isinstance(record, dict) else None


def is_text_network(net: torch.nn.Module) -> bool:
    """Whether net (a Precond) is conditioned on text: its network holds the empty caption's condition."""
    return getattr(getattr(net, "network", None), "empty_text", None) is not None


def recorded_encoder_name(record: dict) -> str:
    """The name of the text encoder a text_encoding record names (as the dataset's encode-text was given it)."""
    encoder = record.get("encoder")
    return str(encoder.get("name")) if isinstance(encoder, dict) else "(none recorded)"


def load_prompt_encoder(record: dict, text_encoder: str | os.PathLike | None,
                        device: torch.device | str = "cpu") -> TextEncoder:
    """The text encoder text_encoder names (a folder, or an ID transformers has in its cache or may download),
    or without one the recorded encoder's folder where it exists here, at the record's token length, checked to be
    the recorded one (check_encoder_matches); otherwise refused naming the recorded encoder: nothing is fetched
    unasked."""
    if text_encoder is None:
        recorded = recorded_encoder_name(record)
        if not os.path.isdir(recorded):
            raise PromptError(f"this network's text embeddings came from the text encoder {shown(recorded)}, "
                              "no folder here: give its folder (or its ID to download it)")
        text_encoder = recorded
    tokens = record.get("tokens")
    encoder = load_text_encoder(text_encoder, tokens=tokens if isinstance(tokens, int) else None, device=device)
    check_encoder_matches(record, encoder)
    return encoder


class PromptConditions:
    """The conditions [N, 1 + L, D + 1] of prompts, encoded as training's online encoding does (rounded through
    float16 as the cached embeddings are), for a list of prompts whose seed s gets prompts[s % len(prompts)]."""

    def __init__(self, encoder: TextEncoder, prompts: Sequence[str] = ()):
        self.online, self.prompts = OnlineConditions(encoder), list(prompts)

    def of_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        """The conditions of these prompts, one each."""
        return self.online(list(prompts))

    def of_seeds(self, seeds: Sequence[int]) -> torch.Tensor:
        """The conditions of the prompts of these seeds (prompt_of_seed)."""
        return self.of_prompts(self.prompts_of_seeds(seeds))

    def prompts_of_seeds(self, seeds: Sequence[int]) -> list[str]:
        """The prompt of each seed."""
        return [prompt_of_seed(self.prompts, int(seed)) for seed in seeds]
