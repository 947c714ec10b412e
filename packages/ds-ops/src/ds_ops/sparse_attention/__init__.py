"""Block-sparse self-attention (``deepspeed.ops.sparse_attention``): DeepSpeed's sparsity layouts, a torch
implementation of sparse self-attention that computes only their blocks (beside its masked dense reference), and
helpers to use it in BERT/RoBERTa models."""

from .bert_sparse_self_attention import BertSparseSelfAttention
from .block_sparse import BlockPlan, block_sparse_attention, make_plan
from .masked_dense import layout_to_token_mask, masked_dense_attention
from .sparse_attention_utils import SparseAttentionUtils
from .sparse_self_attention import SparseSelfAttention
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
    "masked_dense_attention", "make_plan", "BlockPlan",
]
