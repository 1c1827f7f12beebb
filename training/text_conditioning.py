"""The text side of a training run: the text network's arguments from the data's text embeddings
(edm2.text_condition), the empty caption's condition put into the network, and text dropout."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edm2.networks import Precond
from training.architecture import effective

if TYPE_CHECKING:
    from edm2.data.dataset import ImageData

TEXT_OPTIONS = ("text_attention", "text_attention_kind")  # the U-Net options that shape text conditioning


def has_text(dataset: ImageData) -> bool:
    """Whether the data carries text embeddings, so that the run trains a text network on its conditions."""
    return bool(getattr(dataset, "has_text", False))


def text_description(dataset: ImageData) -> dict:
    """What a run's options (TrainingOptions.dataset) and so its snapshots record of the data's text: its
    text_encoding record (encoder, tokens, dim, pooled); nothing for data without text."""
    return dict(text_encoding=dict(dataset.text_record)) if has_text(dataset) else {}


def text_network(dataset: dict, network: dict) -> dict:
    """The Precond arguments of text conditioning for data of this description (TrainingOptions.dataset) and these
    network arguments: text_dim and text_tokens from the text_encoding record, and the attention over the tokens
    where the options put it (by default at the U-Net's attention resolutions, cross); none without text."""
    record = dataset.get("text_encoding")
    if record is None:
        return {}
    return dict(text_dim=record["dim"], text_tokens=record["tokens"],
                text_attention=network.get("text_attention", effective(network, "attn_resolutions")),
                text_attention_kind=network.get("text_attention_kind", "cross"))


def put_empty_condition(net: Precond, dataset: ImageData) -> None:
    """Copy the data's empty-caption condition into a text network (its buffer unet.empty_text, saved with every
    snapshot): the unconditional branch of guidance and what text dropout trains."""
    empty = getattr(net.network, "empty_text", None)
    if empty is not None:
        with torch.no_grad():
            empty.copy_(torch.as_tensor(dataset.empty_condition()).reshape(empty.shape))
