"""The model-parallel regions of the compression library's Megatron-style layers (``ColumnParallelLinear_Compress``
/ ``RowParallelLinear_Compress`` in ``basic_layer``): autograd functions over a model-parallel group, so the layers
train. ``Copy``: identity forward, gradients summed backward; ``Reduce``: the converse; ``Scatter``: this rank's
slice of the last dimension forward, gathered backward; ``Gather``: the converse.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _world(group: Any) -> int:
    return dist.get_world_size(group=group) if dist.is_initialized() else 1


def _split_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    if x.shape[-1] % world:
        raise ValueError(f"model-parallel split: last dimension {x.shape[-1]} does not divide into {world} ranks")
    return x.chunk(world, dim=-1)[dist.get_rank(group=group)].contiguous()


def _gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    if _world(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x


class Copy(torch.autograd.Function):
    """Forward: the input as is (replicated on every rank); backward: the gradients summed over the group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        return _all_reduce(grad.clone(), ctx.group), None


class Reduce(torch.autograd.Function):
    """Forward: the partial outputs summed over the group; backward: the gradient as is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        return grad, None


class Scatter(torch.autograd.Function):
    """Forward: this rank's slice of the last dimension; backward: the slices' gradients gathered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        return _gather_last(grad, ctx.group), None


class Gather(torch.autograd.Function):
    """Forward: every rank's slice concatenated along the last dimension; backward: this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        return _split_last(grad, ctx.group), None
