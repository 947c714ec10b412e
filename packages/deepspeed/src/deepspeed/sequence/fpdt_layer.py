"""FPDT, the Fully Pipelined Distributed Transformer (DeepSpeed Ulysses-Offload): ``deepspeed.sequence.fpdt_layer``.

Long-context training on top of DeepSpeed-Ulysses: the sequence is split over the ranks of a sequence-parallel
group in FPDT order (``FPDT_InputConstruct``), and attention, the feed-forward block and the vocabulary loss run a
chunk of tokens at a time, attention keeping finished chunks in host memory. Results equal the unchunked layers.
The pieces live in ``fpdt_input`` (token order), ``fpdt_kernels`` (block attention and the log-sum-exp merge),
``fpdt_offload`` (host copies), ``fpdt_attention`` (the chunked attention functions) and ``fpdt_mlp`` (feed-forward
and loss); this module adds the ``FPDT_Attention`` layer and serves DeepSpeed's names. See docs/fpdt.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from deepspeed.sequence.fpdt_attention import _FPDTGPUAttentionImpl_, _FPDTGPUOffloadingAttentionImpl_
from deepspeed.sequence.fpdt_input import FPDT_InputConstruct, fpdt_token_order
from deepspeed.sequence.fpdt_kernels import (
    apply_rotary_pos_emb_backward,
    block_attention_backward,
    block_attention_forward,
    flash_attn_available,
    update_out_and_lse,
)
from deepspeed.sequence.fpdt_mlp import FPDT_FFN, FPDT_LogitsLoss, bias_gelu, bias_gelu_back
from deepspeed.sequence.fpdt_offload import SequenceChunk
from deepspeed.sequence.layer import apply_rotary_pos_emb

__all__ = [
    "FPDT_Attention", "FPDT_FFN", "FPDT_InputConstruct", "FPDT_LogitsLoss", "SequenceChunk",
    "_FPDTGPUAttentionImpl_", "_FPDTGPUOffloadingAttentionImpl_", "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_backward", "bias_gelu", "bias_gelu_back", "block_attention_backward",
    "block_attention_forward", "flash_attn_available", "fpdt_token_order", "update_out_and_lse",
]

_CONFIG_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "kv_channels", "attention_dropout")


class FPDT_Attention(torch.nn.Module):
    """Megatron-style self-attention (fused qkv projection, causal attention, output projection) with FPDT.

    ``config``: has ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``kv_channels`` (head
    size) and ``attention_dropout``. ``first_weight``/``first_bias``: the fused qkv projection, rows q, k, v
    (``kv_channels * (heads + 2 * kv_heads)`` rows); ``second_weight``/``second_bias``: the output projection.
    ``chunk_size``: the global FPDT chunk in tokens. ``return_bias``: return the output bias instead of adding it.
    ``enable_offloading`` is kept for DeepSpeed's signature; ``forward(cpu_offloading=...)`` decides.
    """

    def __init__(self, config: Any, first_weight: Tensor, first_bias: Tensor | None, second_weight: Tensor,
                 second_bias: Tensor | None, sequence_process_group: Any, gather_idx: int = 0, scatter_idx: int = 2,
                 return_bias: bool = True, chunk_size: int = 65536, enable_offloading: bool = True) -> None:
        super().__init__()
        missing = [f for f in _CONFIG_FIELDS if not hasattr(config, f)]
        if missing:
            raise ValueError(f"FPDT_Attention: config lacks {', '.join(missing)} (needs {', '.join(_CONFIG_FIELDS)})")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"FPDT_Attention: chunk_size must be a positive integer, got {chunk_size!r}")
        self.spg, self.config = sequence_process_group, config
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_attention_head = config.kv_channels
        self.kv_projection_size = config.kv_channels * config.num_key_value_heads
        self.hidden_size = config.hidden_size
        expected_rows = self.projection_size + 2 * self.kv_projection_size
        if first_weight.shape[0] != expected_rows:
            raise ValueError(f"FPDT_Attention: first_weight has {first_weight.shape[0]} rows; the fused q/k/v "
                             f"projection needs kv_channels * (num_attention_heads + 2 * num_key_value_heads) = "
                             f"{expected_rows}")
        self.qkv_linear_weight, self.qkv_linear_bias = first_weight, first_bias
        self.qkv_dense_weight, self.qkv_dense_bias = second_weight, second_bias
        self.return_bias = return_bias
        self.dropout = float(config.attention_dropout)
        self.chunk_size = chunk_size
        self.double_buffer = enable_offloading

    def num_chunks(self, local_seq_len: int) -> int:
        """Chunks per rank for a local sequence of ``local_seq_len`` tokens."""
        world = dist.get_world_size(self.spg)
        total = local_seq_len * world
        if total % self.chunk_size or total < self.chunk_size:
            raise ValueError(f"FPDT_Attention: the global sequence length ({total} = {local_seq_len} tokens x "
                             f"{world} ranks) must be a positive multiple of chunk_size ({self.chunk_size})")
        return total // self.chunk_size

    def forward(self, layernorm_output: Tensor, attention_mask: Any, inference_params: Any, rotary_pos_emb: Any,
                cpu_offloading: bool = True) -> tuple[Tensor, Tensor | None]:
        """``layernorm_output [l, b, hidden]`` (this rank's tokens in FPDT order) -> ``(out [l, b, hidden],
        output bias or None)``. Dropout applies in training mode only."""
        num_chunks = self.num_chunks(layernorm_output.shape[0])
        impl = _FPDTGPUOffloadingAttentionImpl_ if cpu_offloading and num_chunks > 1 else _FPDTGPUAttentionImpl_
        context = impl.apply(layernorm_output, attention_mask, inference_params, rotary_pos_emb, self.spg,
                             self.scatter_idx, self.gather_idx, self.hidden_size, self.projection_size,
                             self.hidden_size_per_attention_head, self.kv_projection_size, self.qkv_linear_weight,
                             self.qkv_linear_bias, self.dropout if self.training else 0.0, num_chunks,
                             cpu_offloading)
        output = torch.matmul(context.flatten(2).transpose(0, 1), self.qkv_dense_weight.t())
        if self.return_bias:
            return output, self.qkv_dense_bias
        if self.qkv_dense_bias is not None:
            output = output + self.qkv_dense_bias
        return output, None
