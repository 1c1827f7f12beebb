"""A tiny offline text encoder for the tests and the captioned toy: a random T5 or CLIP text model built from a
small config, with a word-level tokenizer, saved as transformers saves a downloaded one."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

TOY_WORDS = ("a", "red", "yellow", "green", "cyan", "blue", "magenta", "circle", "square", "triangle", "ring",
             "cross", "diamond", "star", "on", "the", "left", "right")
SPECIALS = {"t5": ("<pad>", "</s>", "<unk>"), "clip": ("<pad>", "<|endoftext|>", "<unk>", "<|startoftext|>")}


def word_tokenizer(kind: str, vocabulary: Sequence[str], max_length: int):
    """A PreTrainedTokenizerFast over whole words (lower-cased, split at white space and punctuation) that ends a
    caption with EOS as T5's does, and for CLIP also starts it with BOS."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    specials = SPECIALS[kind]
    words = list(specials) + [w for w in dict.fromkeys(vocabulary) if w not in specials]
    vocab = {word: i for i, word in enumerate(words)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    eos = specials[1]
    if kind == "t5":
        tokenizer.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, vocab[eos])])
    else:
        bos = specials[3]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A {eos}", special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])])
    extra = {"bos_token": specials[3]} if kind == "clip" else {}
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token=eos, unk_token="<unk>",
                                   model_max_length=max_length, **extra), vocab


def tiny_text_encoder(folder: Path, kind: str = "t5", vocabulary: Sequence[str] = TOY_WORDS, dim: int = 16) -> Path:
    """Save a random tiny T5 encoder or CLIP text model (fixed seed: the same weights every time) with a word-level
    tokenizer of vocabulary into folder, loadable by from_pretrained; returns folder."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, vocab = word_tokenizer(kind, vocabulary, 77 if kind == "clip" else 512)
    if kind == "t5":
        config = T5Config(vocab_size=len(vocab), d_model=dim, d_kv=dim // 2, d_ff=2 * dim, num_layers=1,
                          num_heads=2, relative_attention_num_buckets=8, pad_token_id=vocab["<pad>"],
                          eos_token_id=vocab["</s>"], decoder_start_token_id=vocab["<pad>"])
        model_class = T5EncoderModel
    elif kind == "clip":
        config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=dim, intermediate_size=2 * dim,
                                num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77,
                                pad_token_id=vocab["<pad>"], bos_token_id=vocab["<|startoftext|>"],
                                eos_token_id=vocab["<|endoftext|>"])
        model_class = CLIPTextModel
    else:
        raise ValueError(f"kind is t5 or clip, not {kind!r}")
    torch.manual_seed(0)
    model = model_class(config).eval()
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


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
