"""A tiny random CLIP (vision + text) with a word-level BPE tokenizer, in the published repository's file layout, and
the pins that make it the CLIP score's detector for one test."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Sequence

import torch

from edm2.eval import clip_score

WORDS = ("a", "red", "green", "blue", "circle", "square", "on", "the", "left", "right")
START, END = "<|startoftext|>", "<|endoftext|>"


def tiny_clip_architecture(vocab_size: int, image_size: int = 28) -> dict:
    """CLIPConfig's arguments of a 2-layer, 32-wide CLIP projecting to 8 features."""
    common = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2)
    return dict(vision_config=dict(common, image_size=image_size, patch_size=14),
                text_config=dict(common, vocab_size=vocab_size, max_position_embeddings=12, bos_token_id=0,
                                 eos_token_id=1, pad_token_id=1),
                projection_dim=8)


def word_bpe(words: Sequence[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's BPE form of a word list: every word one token (its letters merged left to right, '</w>' ending it)."""
    vocab = {START: 0, END: 1}
    merges: dict[tuple[str, str], None] = {}
    for word in words:
        parts = [*word[:-1], word[-1] + "</w>"]
        for part in parts:
            vocab.setdefault(part, len(vocab))
        merged = parts[0]
        for part in parts[1:]:
            merges[(merged, part)] = None
            merged += part
            vocab.setdefault(merged, len(vocab))
    return vocab, list(merges)


def tiny_clip(folder: Path, words: Sequence[str] = WORDS, seed: int = 0, image_size: int = 28) -> Path:
    """Write a random tiny CLIPModel (save_pretrained) and its tokenizer files into folder; return folder."""
    import transformers

    vocab, merges = word_bpe(words)
    torch.manual_seed(seed)
    config = transformers.CLIPConfig(**tiny_clip_architecture(len(vocab), image_size))
    transformers.CLIPModel(config).save_pretrained(folder)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return folder


def tiny_clip_release(folder: Path, image_size: int = 28) -> clip_score.ClipRelease:
    """The release record of tiny_clip's files: its architecture, and each file pinned by its SHA-256."""
    def pinned(published, name):
        return dataclasses.replace(published, sha256=hashlib.sha256((folder / name).read_bytes()).hexdigest())

    vocab = json.loads((folder / "vocab.json").read_text())
    return clip_score.ClipRelease(tiny_clip_architecture(len(vocab), image_size),
                                  *(pinned(published, name) for name, published in clip_score.VIT_L14.files().items()))


def pin_tiny_clip(monkeypatch, folder: Path, image_size: int = 28) -> clip_score.ClipRelease:
    """For one test, make tiny_clip's files in folder the published CLIP release (as pin_detector_file does)."""
    release = tiny_clip_release(folder, image_size)
    monkeypatch.setattr(clip_score, "VIT_L14", release)
    return release
