"""The tiny offline text encoder of the tests and the captioned toy (one implementation:
scripts/tiny_text_encoder.py)."""

from scripts.tiny_text_encoder import SPECIALS, TOY_WORDS, tiny_text_encoder, word_tokenizer

__all__ = ["SPECIALS", "TOY_WORDS", "tiny_text_encoder", "word_tokenizer"]
