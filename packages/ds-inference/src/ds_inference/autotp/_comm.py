"""Autograd-aware collectives of tensor parallelism (Megatron's f/g operators) over one process group.

Each op is the forward/backward pair that keeps a sharded layer's gradients equal to the unsharded model's:
``copy_to_tp`` (identity, all-reduce the gradient) enters a column-parallel layer, ``reduce_from_tp``
(all-reduce, identity gradient) leaves a row-parallel one, ``scatter_to_tp``/``gather_from_tp`` move between a
replicated tensor and this rank's slice of its last dimension (slices may be uneven: ``sizes`` per rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group=group)


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    tensor = tensor.contiguous()
    dist.all_reduce(tensor, group=group)
    return tensor


def all_gather_uneven(tensor: torch.Tensor, sizes: Sequence[int], dim: int,
                      group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's slice along ``dim``; slice ``r`` holds ``sizes[r]`` entries (padded on the wire,
    since gloo's all_gather wants equal shapes)."""
    dim = dim % tensor.dim()
    longest = max(sizes)
    pad = longest - tensor.shape[dim]
    if pad:
        widths = [0, 0] * (tensor.dim() - 1 - dim) + [0, pad]
        tensor = torch.nn.functional.pad(tensor, widths)
    pieces = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in sizes]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat([piece.narrow(dim, 0, size) for piece, size in zip(pieces, sizes, strict=True)], dim=dim)


def _local_slice(tensor: torch.Tensor, sizes: Sequence[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    rank = _rank(group)
    return tensor.narrow(-1, sum(sizes[:rank]), sizes[rank]).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        return _all_reduce(tensor.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _local_slice(tensor, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_uneven(grad, ctx.sizes, -1, ctx.group), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return all_gather_uneven(tensor, sizes, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _local_slice(grad, ctx.sizes, ctx.group), None, None


def copy_to_tp(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Identity forward; the backward sums the input gradient over the group (column-parallel input)."""
    return _CopyToTP.apply(tensor, group)


def reduce_from_tp(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over the group forward; identity backward (row-parallel output)."""
    return _ReduceFromTP.apply(tensor, group)


def scatter_to_tp(tensor: torch.Tensor, sizes: Sequence[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's slice of the last dimension; the backward all-gathers the gradient."""
    return _ScatterToTP.apply(tensor, tuple(sizes), group)


def gather_from_tp(tensor: torch.Tensor, sizes: Sequence[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """All ranks' slices concatenated along the last dimension; the backward keeps this rank's slice."""
    return _GatherFromTP.apply(tensor, tuple(sizes), group)
