"""``SparseSelfAttention``: DeepSpeed's module over ``block_sparse.block_sparse_attention``.

DeepSpeed runs Triton block-sparse kernels; here the blocks the layout keeps are gathered and attended in chunks,
so time and memory grow with the layout's non-zero blocks, not with L^2 (see ``block_sparse.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .block_sparse import DEFAULT_CHUNK_ELEMENTS, BlockPlan, block_sparse_attention, make_plan
from .masked_dense import MASK_MODES
from .sparsity_config import SparsityConfig


class SparseSelfAttention(nn.Module):
    """Sparse self-attention of `Generative Modeling with Sparse Transformers` (arXiv:1904.10509).

    ``forward(query, key, value)`` takes ``[batch, heads, seq, head_dim]`` tensors, seq a multiple of the block.
    The layout for seq is the top-left corner of ``master_layout`` (made for ``max_seq_length``), as in DeepSpeed.
    """

    def __init__(self, sparsity_config=SparsityConfig(num_heads=4), key_padding_mask_mode='add',  # noqa: B008
                 attn_mask_mode='mul', max_seq_length=2048):
        super().__init__()
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in MASK_MODES:
                raise ValueError(f"{name} must be 'add' or 'mul', got {mode!r}")
        self.sparsity_config = sparsity_config
        self.register_buffer("master_layout", sparsity_config.make_layout(max_seq_length))
        self._need_layout_synchronization = True
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.chunk_elements = DEFAULT_CHUNK_ELEMENTS  # scores per chunk: the work space, see block_sparse.py
        self._plans: dict[tuple[int, str], BlockPlan] = {}

    def get_layout(self, L):
        """The ``[H, L/block, L/block]`` layout for sequence length L (rank 0's, once a process group exists)."""
        if self._need_layout_synchronization and dist.is_available() and dist.is_initialized():
            dist.broadcast(self.master_layout, src=0)  # random layouts must agree across ranks
            self._need_layout_synchronization = False
            self._plans.clear()
        if L % self.sparsity_config.block != 0:
            raise ValueError(f'Sequence Length, {L}, needs to be dividable by Block size {self.sparsity_config.block}!')
        num_blocks = L // self.sparsity_config.block
        if num_blocks > self.master_layout.shape[-1]:
            raise ValueError(f"Sequence Length, {L}, is longer than max_seq_length, "
                             f"{self.master_layout.shape[-1] * self.sparsity_config.block}")
        return self.master_layout[..., :num_blocks, :num_blocks].cpu()

    def _plan(self, L: int, device: torch.device) -> BlockPlan:
        key = (L, str(device))
        if key not in self._plans:
            self._plans[key] = make_plan(self.get_layout(L), self.sparsity_config.block, device)
        return self._plans[key]

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
        return block_sparse_attention(query, key, value, self._plan(tgt_len, query.device), float(head_dim) ** -0.5,
                                      rpe=rpe, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                      key_padding_mask_mode=self.key_padding_mask_mode,
                                      attn_mask_mode=self.attn_mask_mode, chunk_elements=self.chunk_elements)
