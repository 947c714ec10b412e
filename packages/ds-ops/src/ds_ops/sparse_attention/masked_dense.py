"""The plain reference for block-sparse attention: dense ``[B, H, L, L]`` scores with the dropped blocks masked.

It costs what dense attention costs (O(L^2) memory and time whatever the layout); ``block_sparse.py`` computes the
same function over the layout's blocks only and is tested against this one.
"""

from __future__ import annotations

import torch

MASK_MODES = ("add", "mul")


def layout_to_token_mask(layout: torch.Tensor, block: int) -> torch.Tensor:
    """``[H, nb, nb]`` block layout -> ``[H, nb*block, nb*block]`` bool mask (True: query attends to key)."""
    return layout.bool().repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)


def additive_mask(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """DeepSpeed's mask modes: 'add' adds the mask to the scores; 'mul' drops the positions where it is 0."""
    if mode == "mul":
        return torch.zeros_like(mask).masked_fill(mask == 0, float("-inf"))
    return mask


def masked_dense_attention(query, key, value, token_mask, scale, rpe=None, key_padding_mask=None, attn_mask=None,
                           key_padding_mask_mode="add", attn_mask_mode="mul"):
    """softmax(q k^T * scale + rpe + masks, over the kept positions) v, in at least float32; a row with nothing
    kept gives 0.

    query/key/value ``[B, H, L, D]``; token_mask ``[H, L, L]`` bool; key_padding_mask ``[B, L]``; attn_mask
    ``[L, L]``; rpe broadcastable to ``[B, H, L, L]``.
    """
    dtype = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query.to(dtype), key.to(dtype).transpose(-1, -2)) * scale
    if rpe is not None:
        scores = scores + rpe.to(dtype)
    if key_padding_mask is not None:
        scores = scores + additive_mask(key_padding_mask.to(dtype), key_padding_mask_mode)[:, None, None, :]
    if attn_mask is not None:
        scores = scores + additive_mask(attn_mask.to(dtype), attn_mask_mode)
    scores = scores.masked_fill(~token_mask.to(scores.device), float("-inf"))
    # a row with nothing kept: softmax would give NaN (and NaN gradients); it gives 0 and no gradient instead
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return torch.matmul(probs, value.to(dtype)).to(value.dtype)
