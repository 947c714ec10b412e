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
    """``apply(group, x, input_splits, output_splits)``: rows ``[sum(input_splits), ...]`` ->
    ``[sum(output_splits), ...]``; the ``i``-th input segment goes to rank ``i``, the ``i``-th output segment
    comes from rank ``i``."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: Tensor, input_splits: list[int], output_splits: list[int]) -> Tensor:
        ctx.group, ctx.input_splits, ctx.output_splits = group, input_splits, output_splits
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=output_splits, input_split_sizes=input_splits,
                               group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None]:
        return None, _AllToAllV.apply(ctx.group, grad, ctx.output_splits, ctx.input_splits), None, None
