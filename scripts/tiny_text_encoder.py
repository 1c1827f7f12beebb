"""Write a tiny random text encoder that runs offline: a T5 encoder or a CLIP text model built from a small config
(fixed seed: the same weights every time) with a word-level tokenizer over the captioned toy's words, saved with
save_pretrained as transformers saves a downloaded one, for `dataset_tool.py encode-text --text-encoder=DIR`, the
tests and scripts/text_toy.py. Its embeddings are random but distinct and deterministic per caption, which is all
the toy needs; it knows no language.

    python scripts/tiny_text_encoder.py --dest=tiny-t5 --kind=t5
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import click

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


@click.command()
@click.option("--dest", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="New folder for the encoder (config, weights, tokenizer).")
@click.option("--kind", type=click.Choice(sorted(SPECIALS)), default="t5", show_default=True,
              help="T5 encoder (pooled: masked mean of tokens) or CLIP text model (pooled: its pooler output).")
@click.option("--dim", type=click.IntRange(2, 1024), default=16, show_default=True,
              help="Features per token (even: two attention heads).")
def main(dest: Path, kind: str, dim: int) -> None:
    """Write the tiny random text encoder of the captioned toy's words to DEST."""
    if dim % 2:
        raise click.BadParameter(f"{dim} is odd; the two attention heads need an even width", param_hint="'--dim'")
    if dest.exists() and any(dest.iterdir()):
        raise click.BadParameter(f"{dest} exists and is not empty", param_hint="'--dest'")
    tiny_text_encoder(dest, kind, dim=dim)
    click.echo(f"wrote a tiny random {kind} text encoder ({dim} features, {len(TOY_WORDS)} words) to {dest}")


if __name__ == "__main__":
    main()
