"""Block-sparse self-attention in plain torch: the layout expanded to a token mask over dense scores.

DeepSpeed computes the same thing with Triton block-sparse kernels (only the blocks the layout keeps); this version
materializes ``[batch, heads, L, L]`` scores and masks the dropped blocks with ``-inf``, so its results equal
dense attention restricted to the layout; memory is O(L^2), not O(nnz blocks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .sparsity_config import SparsityConfig

_MASK_MODES = ("add", "mul")


def layout_to_token_mask(layout: torch.Tensor, block: int) -> torch.Tensor:
    """``[H, nb, nb]`` block layout -> ``[H, nb*block, nb*block]`` bool mask (True: query attends to key)."""
    return layout.bool().repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)


def _additive(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """DeepSpeed's mask modes: 'add' adds the mask to the scores; 'mul' drops the positions where it is 0."""
    if mode == "mul":
        return torch.zeros_like(mask).masked_fill(mask == 0, float("-inf"))
    return mask


def block_sparse_attention(query, key, value, token_mask, scale, rpe=None, key_padding_mask=None, attn_mask=None,
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
        scores = scores + _additive(key_padding_mask.to(dtype), key_padding_mask_mode)[:, None, None, :]
    if attn_mask is not None:
        scores = scores + _additive(attn_mask.to(dtype), attn_mask_mode)
    scores = scores.masked_fill(~token_mask.to(scores.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, value.to(dtype)).to(value.dtype)


class SparseSelfAttention(nn.Module):
    """Sparse self-attention of `Generative Modeling with Sparse Transformers` (arXiv:1904.10509).

    ``forward(query, key, value)`` takes ``[batch, heads, seq, head_dim]`` tensors, seq a multiple of the block.
    The layout for seq is the top-left corner of ``master_layout`` (made for ``max_seq_length``), as in DeepSpeed.
    """

    def __init__(self, sparsity_config=SparsityConfig(num_heads=4), key_padding_mask_mode='add',  # noqa: B008
                 attn_mask_mode='mul', max_seq_length=2048):
        super().__init__()
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in _MASK_MODES:
                raise ValueError(f"{name} must be 'add' or 'mul', got {mode!r}")
        self.sparsity_config = sparsity_config
        self.register_buffer("master_layout", sparsity_config.make_layout(max_seq_length))
        self._need_layout_synchronization = True
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self._token_masks: dict[tuple[int, str], torch.Tensor] = {}

    def get_layout(self, L):
        """The ``[H, L/block, L/block]`` layout for sequence length L (rank 0's, once a process group exists)."""
        if self._need_layout_synchronization and dist.is_available() and dist.is_initialized():
            dist.broadcast(self.master_layout, src=0)  # random layouts must agree across ranks
            self._need_layout_synchronization = False
            self._token_masks.clear()
        if L % self.sparsity_config.block != 0:
            raise ValueError(f'Sequence Length, {L}, needs to be dividable by Block size {self.sparsity_config.block}!')
        num_blocks = L // self.sparsity_config.block
        if num_blocks > self.master_layout.shape[-1]:
            raise ValueError(f"Sequence Length, {L}, is longer than max_seq_length, "
                             f"{self.master_layout.shape[-1] * self.sparsity_config.block}")
        return self.master_layout[..., :num_blocks, :num_blocks].cpu()

    def _token_mask(self, L: int, device: torch.device) -> torch.Tensor:
        key = (L, str(device))
        if key not in self._token_masks:
            layout = self.get_layout(L)
            self._token_masks[key] = layout_to_token_mask(layout, self.sparsity_config.block).to(device)
        return self._token_masks[key]

    def transpose_key_for_scores(self, x, L):
        """Accept keys given as ``[B, H, D, L]`` (already transposed) too."""
        if x.size(2) != L:
            return x.permute(0, 1, 3, 2)
        return x

    def transpose_mask_for_sparse(self, qtype, x, is_key_padding_mask=False):
        x = x.type(qtype)
        if is_key_padding_mask:
            for d in range(x.dim() - 1, 0, -1):
                x = x.squeeze(dim=d)
            return x
        return x.squeeze()

    def forward(self, query, key, value, rpe=None, key_padding_mask=None, attn_mask=None):
        """Attention context ``[B, H, L, D]``; key_padding_mask ``[B, L]`` (or ``[B, 1, 1, L]``), attn_mask
        ``[L, L]``."""
        bsz, num_heads, tgt_len, head_dim = query.size()
        key = self.transpose_key_for_scores(key, tgt_len)
        if query.shape != key.shape or key.shape != value.shape:
            # DeepSpeed's exception type, so scripts that catch it keep working; the message says what was given
            raise NotImplementedError(f"SparseSelfAttention: only self-attention is supported for now: query, key "
                                      f"and value must have one shape [batch, heads, seq, head_dim]; got query "
                                      f"{list(query.shape)}, key {list(key.shape)}, value {list(value.shape)}")
        if num_heads != self.master_layout.shape[0]:
            raise ValueError(f"query has {num_heads} heads but the sparsity config has {self.master_layout.shape[0]}")
        if key_padding_mask is not None:
            key_padding_mask = self.transpose_mask_for_sparse(query.dtype, key_padding_mask, is_key_padding_mask=True)
        if attn_mask is not None:
            attn_mask = self.transpose_mask_for_sparse(query.dtype, attn_mask)
        return block_sparse_attention(query, key, value, self._token_mask(tgt_len, query.device),
                                      float(head_dim) ** -0.5, rpe=rpe, key_padding_mask=key_padding_mask,
                                      attn_mask=attn_mask, key_padding_mask_mode=self.key_padding_mask_mode,
                                      attn_mask_mode=self.attn_mask_mode)
