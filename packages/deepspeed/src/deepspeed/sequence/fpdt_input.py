"""FPDT's input order: which tokens of a batch each sequence-parallel rank holds, chunk by chunk.

FPDT splits the global sequence of ``L`` tokens into chunks of ``chunk_size`` tokens (DeepSpeed's Megatron
argument ``ds_sequence_parallel_fpdt_chunk_size``) and cuts every chunk into ``P`` equal slices, one per rank of
the sequence-parallel group. Rank ``r`` holds slice ``r`` of every chunk, in chunk order, so that one all-to-all
over the group turns the ranks' ``i``-th local slices back into chunk ``i`` in its original order. Causal
attention over chunks then costs every rank the same (a contiguous split would leave the last rank the most
work).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def fpdt_token_order(global_seq_len: int, chunk_size: int, sp_size: int, device: Any = None) -> Tensor:
    """The permutation of ``range(global_seq_len)`` FPDT lays out over the ranks: rank 0's tokens, then rank 1's.

    Rank ``r``'s tokens are ``[j*chunk_size + r*s, j*chunk_size + (r+1)*s)`` for each chunk ``j``, with
    ``s = chunk_size // sp_size``.
    """
    _check_split(global_seq_len, chunk_size, sp_size)
    chunks, piece = global_seq_len // chunk_size, chunk_size // sp_size
    # [chunk j, rank r, token t] -> position j*chunk_size + r*piece + t; rank-major order
    order = torch.arange(global_seq_len, device=device).reshape(chunks, sp_size, piece)
    return order.transpose(0, 1).reshape(-1)


def _check_split(global_seq_len: int, chunk_size: int, sp_size: int) -> None:
    for name, value in (("chunk_size", chunk_size), ("sp_size", sp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"FPDT: {name} must be a positive integer, got {value!r}")
    if global_seq_len % chunk_size:
        raise ValueError(f"FPDT: the sequence length ({global_seq_len}) must be a multiple of the FPDT chunk size "
                         f"(ds_sequence_parallel_fpdt_chunk_size={chunk_size})")
    if chunk_size % sp_size:
        raise ValueError(f"FPDT: the chunk size ({chunk_size}) must be a multiple of the sequence parallel size "
                         f"({sp_size}), so that every rank holds an equal slice of every chunk")


class FPDT_InputConstruct(torch.nn.Module):
    """Re-order one batch for FPDT: ``generate()`` returns this rank's tokens, labels and position ids.

    ``tokens``, ``labels``, ``position_ids``: ``[b, L, ...]`` (labels and position ids may be None);
    ``loss_mask``: ``[b, L]`` or None, returned in the global FPDT order (every rank's tokens, rank after rank),
    the order in which ``FPDT_LogitsLoss`` gathers the per-token losses; ``attention_mask`` is returned as given.
    ``args.ds_sequence_parallel_fpdt_chunk_size`` is the global chunk size.
    """

    def __init__(self, tokens: Tensor, labels: Tensor | None, loss_mask: Tensor | None,
                 attention_mask: Tensor | None, position_ids: Tensor | None, args: Any, sp_size: int,
                 sp_rank: int) -> None:
        super().__init__()
        chunk = getattr(args, "ds_sequence_parallel_fpdt_chunk_size", None)
        if chunk is None:
            raise ValueError("FPDT_InputConstruct: args has no ds_sequence_parallel_fpdt_chunk_size (the global "
                             "FPDT chunk size in tokens)")
        global_seq_len = tokens.shape[1]
        _check_split(global_seq_len, chunk, sp_size)
        if not 0 <= sp_rank < sp_size:
            raise ValueError(f"FPDT_InputConstruct: sp_rank ({sp_rank}) must be in [0, sp_size={sp_size})")
        self.tokens, self.labels, self.loss_mask = tokens, labels, loss_mask
        self.attention_mask, self.position_ids = attention_mask, position_ids
        self.sp_size, self.sp_rank = sp_size, sp_rank
        self.global_seq_len = global_seq_len
        self.local_seq_len = global_seq_len // sp_size
        self.num_chunk_per_gpu = global_seq_len // chunk
        self.chunk_size = chunk // sp_size  # tokens per rank per chunk
        self.batch_size = tokens.shape[0]
        self.device = tokens.device

    def generate(self) -> tuple[Any, Any, Any, Any, Any]:
        """``(tokens, labels, loss_mask, attention_mask, position_ids)`` for this rank, in FPDT order."""
        order = fpdt_token_order(self.global_seq_len, self.chunk_size * self.sp_size, self.sp_size, self.device)
        mine = order.reshape(self.sp_size, self.local_seq_len)[self.sp_rank]

        def pick(t: Tensor | None, idx: Tensor) -> Tensor | None:
            return None if t is None else t[:, idx.to(t.device)]

        return (pick(self.tokens, mine), pick(self.labels, mine), pick(self.loss_mask, order),
                self.attention_mask, pick(self.position_ids, mine))
