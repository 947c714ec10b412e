"""Block-sparse self-attention (``deepspeed.ops.sparse_attention``): DeepSpeed's sparsity layouts, a torch
implementation of sparse self-attention over them, and helpers to use it in BERT/RoBERTa models."""

from .bert_sparse_self_attention import BertSparseSelfAttention
from .sparse_attention_utils import SparseAttentionUtils
from .sparse_self_attention import SparseSelfAttention, block_sparse_attention, layout_to_token_mask
from .sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = [
    "SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig", "BigBirdSparsityConfig",
    "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig", "SparseSelfAttention",
    "BertSparseSelfAttention", "SparseAttentionUtils", "block_sparse_attention", "layout_to_token_mask",
]
