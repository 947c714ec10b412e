"""Dropless token exchange between expert-parallel ranks: an all-to-all with per-rank split sizes.

DeepSpeed's MoE all-to-all (:mod:`ds_moe._alltoall`) moves equal chunks of capacity-padded buffers; AutoEP drops
no token, so each rank sends exactly the rows routed to each peer's experts (``all_to_all_single`` with split
sizes, DeepSpeed's ``_AllToAllV``). The backward is the same exchange with the splits swapped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class _AllToAllV(torch.autograd.Function):
    """Rows ``[sum(input_splits), ...]`` -> ``[sum(output_splits), ...]``: the ``i``-th input segment goes to
    rank ``i``; the ``i``-th output segment comes from rank ``i``."""

    @staticmethod
    def forward(ctx: Any, group: dist.ProcessGroup, x: Tensor, output_splits: list[int],
                input_splits: list[int]) -> Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        x = x.contiguous()
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits,
                               group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None]:
        return None, _AllToAllV.apply(ctx.group, grad, ctx.input_splits, ctx.output_splits), None, None


def all_to_all_v(group: dist.ProcessGroup, x: Tensor, output_splits: list[int], input_splits: list[int]) -> Tensor:
    """Differentiable variable-split all-to-all of ``x``'s rows over ``group``."""
    return _AllToAllV.apply(group, x, output_splits, input_splits)


def exchange_counts(group: dist.ProcessGroup, send_counts: Tensor) -> Tensor:
    """``send_counts`` ``[ep * L]`` (rows this rank sends to each global expert, rank-major) ->
    ``[ep, L]``: rows each source rank sends to each of this rank's ``L`` local experts."""
    ep = dist.get_world_size(group=group)
    received = torch.empty_like(send_counts)
    dist.all_to_all_single(received, send_counts.contiguous(), group=group)
    return received.view(ep, -1)


def local_expert_order(received: Tensor) -> Tensor:
    """Row permutation taking the received buffer (source-major, then local expert) to local-expert-major
    order (then source), so each local expert's rows are contiguous. ``received``: ``[ep, L]`` counts."""
    counts = received.reshape(-1)
    starts = (torch.cumsum(counts, 0) - counts).view_as(received)
    counts_t, starts_t = received.t().reshape(-1), starts.t().reshape(-1)
    out_starts = torch.cumsum(counts_t, 0) - counts_t
    total = int(counts.sum())
    offset = torch.repeat_interleave(starts_t - out_starts, counts_t, output_size=total)
    return torch.arange(total, device=received.device) + offset
