"""The differentiable all-to-all that moves expert buffers between the ranks of an expert-parallel group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over ``group`` along dim 0; its gradient is the same exchange in reverse.

    Rank ``r`` sends its ``i``-th equal chunk of dim 0 to rank ``i`` and receives rank ``i``'s ``r``-th chunk
    into its ``i``-th chunk. The exchange is its own inverse, so the backward is the same call.
    """

    @staticmethod
    def forward(ctx: Any, group: dist.ProcessGroup, input: Tensor) -> Tensor:  # noqa: A002 (DeepSpeed's name)
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        dist.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> tuple[None, Tensor]:
        return None, _AllToAll.apply(ctx.group, *grad_output)


def all_to_all(group: dist.ProcessGroup, tensor: Tensor) -> Tensor:
    """Differentiable all-to-all of ``tensor``'s dim-0 chunks across ``group``."""
    return _AllToAll.apply(group, tensor)
