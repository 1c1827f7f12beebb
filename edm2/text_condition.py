"""A caption's text condition as one tensor, so that it travels where class labels travel (datasets, batches, label
dropout, the network's conditioning argument).

A text encoder gives per-token embeddings [L, D], the number n <= L of real tokens and a pooled embedding [D]. The
condition packs them as [1 + L, D + 1]: row 0 is the pooled embedding, rows 1..L the tokens (zero past n), and
column D the mask (1 for the pooled row and the n real tokens, 0 for padding). A batch is [N, 1 + L, D + 1].
"""

from __future__ import annotations

import torch


def condition_shape(tokens: int, dim: int) -> tuple[int, int]:
    """The shape [1 + L, D + 1] of one caption's condition for L tokens of D features."""
    return 1 + tokens, dim + 1


def pack_condition(pooled: torch.Tensor, tokens: torch.Tensor, length: int | torch.Tensor) -> torch.Tensor:
    """The condition [..., 1 + L, D + 1] of pooled [..., D], tokens [..., L, D] and the real token count(s)."""
    num_tokens = tokens.shape[-2]
    length = torch.as_tensor(length, device=tokens.device)
    valid = torch.arange(num_tokens, device=tokens.device) < length.unsqueeze(-1)
    rows = torch.cat([pooled.unsqueeze(-2), tokens * valid.unsqueeze(-1).to(tokens.dtype)], dim=-2)
    mask = torch.cat([torch.ones_like(valid[..., :1]), valid], dim=-1).to(rows.dtype)
    return torch.cat([rows, mask.unsqueeze(-1)], dim=-1)


def unpack_condition(condition: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pooled [..., D], tokens [..., L, D], mask [..., L] as bool) of a condition [..., 1 + L, D + 1]."""
    return condition[..., 0, :-1], condition[..., 1:, :-1], condition[..., 1:, -1] > 0.5
