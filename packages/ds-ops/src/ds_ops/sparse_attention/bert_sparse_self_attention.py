"""BERT self-attention (query/key/value projections) over SparseSelfAttention, as DeepSpeed's layer."""

from __future__ import annotations

import torch
from torch import nn

from .sparse_self_attention import SparseSelfAttention
from .sparsity_config import FixedSparsityConfig


class BertSparseSelfAttention(nn.Module):
    """Sparse self-attention layer of a BERT model; ``forward(hidden_states, attention_mask)`` -> context
    ``[batch, seq, hidden]``. attention_mask is BERT's additive key mask (``[B, L]`` or ``[B, 1, 1, L]``)."""

    def __init__(self, config, sparsity_config=FixedSparsityConfig(num_heads=4)):  # noqa: B008
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(f"The hidden size ({config.hidden_size}) is not a multiple of the number of attention "
                             f"heads ({config.num_attention_heads})")
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        max_len = getattr(config, "max_position_embeddings", 2048)
        max_len = -(-max_len // sparsity_config.block) * sparsity_config.block
        self.sparse_self_attention = SparseSelfAttention(sparsity_config, max_seq_length=max(max_len, 2048))

    def transpose_for_scores(self, x):
        x = x.view(*x.size()[:-1], self.num_attention_heads, self.attention_head_size)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        context = self.sparse_self_attention(query_layer, key_layer, value_layer, key_padding_mask=attention_mask)
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(*context.size()[:-2], self.all_head_size)


def _key_mask_from_hf(attention_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Hugging Face's self-attention mask (additive float or bool ``[B, 1, Lq, Lk]``, or None) -> additive ``[B, Lk]``.

    Padding masks repeat the same key mask on every query row, so row 0 carries it.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:
        attention_mask = attention_mask[:, 0, 0, :]
    if attention_mask.dtype == torch.bool:
        return torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device).masked_fill(
            ~attention_mask, float("-inf"))
    return attention_mask.to(dtype)


class HFBertSparseSelfAttention(BertSparseSelfAttention):
    """BertSparseSelfAttention with the call and return convention of Hugging Face's ``BertSelfAttention``
    (transformers 4.x and 5.x): ``forward(hidden_states, attention_mask=None, ...)`` -> ``(context, None)``.

    Only the key padding mask is used; a causal or per-query mask cannot be expressed (sparse attention is for
    bidirectional encoders here)."""

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        context = super().forward(hidden_states, _key_mask_from_hf(attention_mask, hidden_states.dtype))
        return context, None
