"""The tiny offline text encoder of the tests and the captioned toy (one implementation:
scripts/tiny_text_encoder.py), and a tiny text network's snapshot that records it."""

from __future__ import annotations

from pathlib import Path

from scripts.tiny_text_encoder import SPECIALS, TOY_WORDS, tiny_text_encoder, word_tokenizer

__all__ = ["SPECIALS", "TOY_WORDS", "tiny_text_encoder", "tiny_text_snapshot", "word_tokenizer"]


def tiny_text_snapshot(path: Path, encoder_folder: Path, tokens: int = 6, text_dropout: float = 0.1,
                       seed: int = 0) -> Path:
    """Save a randomized tiny 8x8 RGB text network (cross attention at 4x4) as a snapshot whose metadata records
    the text encoder of encoder_folder (its text_encoding record, at `tokens` tokens) and text_dropout, its empty
    caption's condition encoded by that encoder, as a training run saves one; returns path."""
    import torch

    from edm2.encoders import StandardRGBEncoder
    from edm2.formats.snapshot import save_network
    from edm2.text_encoders import OnlineConditions, load_text_encoder
    from tests.helpers import randomized, tiny_precond

    encoder = load_text_encoder(encoder_folder, tokens=tokens)
    net = randomized(tiny_precond(label_dim=0, text_dim=encoder.dim, text_tokens=tokens, text_attention=[4]),
                     seed).eval().requires_grad_(False)
    with torch.no_grad():
        net.unet.empty_text.copy_(OnlineConditions(encoder).empty_condition())
    options = {"text_dropout": text_dropout} if text_dropout else {}
    save_network(path, net, {"encoder": StandardRGBEncoder().config(), "dataset": {"text_encoding": encoder.record()},
                             "training_options": options})
    return path
