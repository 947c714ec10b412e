"""Regrouping routed rows by local expert, with each expert's rows padded to an aligned count (DeepSpeed's
``ep_kernels``; vectorised torch, no Triton).

After the dispatch all-to-all a rank holds rows ordered by source rank, then by local expert. Grouped GEMMs want
each expert's rows contiguous, and their group sizes multiples of ``TOKEN_GROUP_ALIGN_SIZE_M`` (16 bytes of bf16);
an expert with no rows still gets one aligned group of padding. Padding slots index ``-1``: the caller points
them at an appended zero row.
"""

from __future__ import annotations

import torch
from torch import Tensor

TOKEN_GROUP_ALIGN_SIZE_M = 8
"""Rows per aligned group: 8 for bf16 (16 bytes / 2 bytes per element)."""


def _round_up(x: int, y: int) -> int:
    return (x + y - 1) // y * y


def generate_permute_indices(tokens_per_expert_group: Tensor, experts_per_rank: int, num_ranks: int, max_len: int,
                             alignment: int, use_cpu: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(permuted_indices [max_len] int32, m_sizes [experts_per_rank] int32, m_offsets)``.

    ``tokens_per_expert_group``: ``[num_ranks * experts_per_rank]`` row counts, source-rank major (the received
    layout). ``m_sizes[e]``: expert ``e``'s rows (all sources) rounded up to ``alignment`` (at least
    ``alignment``); ``permuted_indices[j]``: the received row at slot ``j`` of the expert-grouped layout, or -1
    for padding (and past the last group). ``use_cpu`` is accepted for DeepSpeed's signature: the computation
    runs on the counts' device either way."""
    counts = tokens_per_expert_group.to(torch.int64).view(num_ranks, experts_per_rank)
    starts = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view_as(counts)
    per_expert = counts.sum(dim=0)
    m_sizes = ((per_expert.clamp_min(alignment) + alignment - 1) // alignment * alignment).to(torch.int32)
    m_offsets = torch.cumsum(m_sizes, 0)
    write_starts = m_offsets.to(torch.int64) - m_sizes.to(torch.int64)
    # segment (expert e, source r) lands at write_starts[e] + rows of e from sources before r
    seg_counts = counts.t().reshape(-1)
    seg_src = starts.t().reshape(-1)
    within = (torch.cumsum(counts, 0) - counts).t().reshape(-1)
    seg_dst = write_starts.repeat_interleave(num_ranks) + within
    total = int(seg_counts.sum())
    offsets = torch.arange(total, device=counts.device) - torch.repeat_interleave(
        torch.cumsum(seg_counts, 0) - seg_counts, seg_counts, output_size=total)
    dst = torch.repeat_interleave(seg_dst, seg_counts, output_size=total) + offsets
    src = torch.repeat_interleave(seg_src, seg_counts, output_size=total) + offsets
    permuted = torch.full((max_len,), -1, dtype=torch.int32, device=counts.device)
    keep = dst < max_len
    permuted[dst[keep]] = src[keep].to(torch.int32)
    return permuted, m_sizes, m_offsets


def permute_by_local_expert(tokens: Tensor, local_counts: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """Rows grouped by local expert, each group padded to the alignment with zero rows.

    ``local_counts``: ``[E_local]`` (rows already expert-ordered) or ``[ep, E_local]`` (received layout).
    Returns ``(rows [N_padded, H], permuted_indices [N_padded], aligned_counts [E_local], n_tokens)``."""
    if local_counts.dim() not in (1, 2):
        raise ValueError(f"local_counts must be [E_local] or [ep, E_local], got shape {tuple(local_counts.shape)}")
    ranks, experts = (1, local_counts.shape[0]) if local_counts.dim() == 1 else tuple(local_counts.shape)
    n_tokens = tokens.shape[0]
    align = TOKEN_GROUP_ALIGN_SIZE_M
    max_len = _round_up(n_tokens + experts * align, align)
    with torch.no_grad():
        indices, m_sizes, _ = generate_permute_indices(local_counts.reshape(-1), experts, ranks, max_len, align)
    indices = indices.to(tokens.device).long()
    indices[indices < 0] = n_tokens  # padding reads the appended zero row
    padded = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[-1])])
    return padded.index_select(0, indices), indices, m_sizes.to(tokens.device), n_tokens


def unpermute_by_local_expert(expert_output: Tensor, permuted_indices: Tensor, n_tokens: int) -> Tensor:
    """Undo :func:`permute_by_local_expert`: rows back in their original order, padding dropped."""
    out = expert_output.new_zeros(n_tokens + 1, expert_output.shape[-1])
    out = out.index_copy(0, permuted_indices, expert_output)  # padding rows all land on (and vanish with) row n
    return out[:n_tokens]
