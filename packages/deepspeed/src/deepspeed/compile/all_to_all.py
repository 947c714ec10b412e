"""The all-to-all AutoSP inserts into compiled graphs, as a torch custom op.

A custom op is opaque to Dynamo, AOT autograd and Inductor (it runs as an extern call with its Python body), has a
fake implementation for shape propagation, and carries its own backward (the same exchange, reversed). Process
groups cannot be op arguments, so graphs name them by an integer key into ``_GROUPS``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from deepspeed import comm

_GROUPS: dict[int, Any] = {}


def register_group(group: Any) -> int:
    """The key compiled graphs use for ``group`` (registered once)."""
    for key, known in _GROUPS.items():
        if known is group:
            return key
    key = len(_GROUPS)
    _GROUPS[key] = group
    return key


def group_size(key: int) -> int:
    return dist.get_world_size(_GROUPS[key])


@torch.library.custom_op("ds_autosp::all_to_all", mutates_args=())
def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: int) -> torch.Tensor:
    """Split ``x`` into P chunks along ``scatter_dim``, send chunk i to rank i of the group, and concatenate the
    received chunks along ``gather_dim`` in rank order (P = the group's size)."""
    if x.dtype == torch.bool:  # boolean masks travel as bytes (gloo has no bool collectives)
        return all_to_all(x.to(torch.uint8), scatter_dim, gather_dim, group).to(torch.bool)
    world = group_size(group)
    size = x.shape[scatter_dim]
    if size % world:
        raise ValueError(f"AutoSP all-to-all: dimension {scatter_dim} of a {tuple(x.shape)} tensor ({size}) must be "
                         f"divisible by the sequence parallel size ({world})")
    send = x.unflatten(scatter_dim, (world, size // world)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=_GROUPS[group])
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


@all_to_all.register_fake
def _all_to_all_fake(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: int) -> torch.Tensor:
    world = group_size(group)
    shape = list(x.shape)
    shape[scatter_dim] //= world
    shape[gather_dim] *= world
    return x.new_empty(shape)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    _, ctx.scatter_dim, ctx.gather_dim, ctx.group = inputs


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return all_to_all(grad.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.group), None, None, None


all_to_all.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("ds_autosp::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, group: int) -> torch.Tensor:
    """Concatenate every group rank's ``x`` along ``dim`` in rank order (attention masks built from a sequence
    shard: rows of the other ranks' queries). Not differentiable: masks carry no gradient."""
    if x.dtype == torch.bool:
        return all_gather(x.to(torch.uint8), dim, group).to(torch.bool)
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=_GROUPS[group])
    return torch.cat(parts, dim=dim)


@all_gather.register_fake
def _all_gather_fake(x: torch.Tensor, dim: int, group: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= group_size(group)
    return x.new_empty(shape)


def group_of(key: int) -> Any:
    """The process group registered under ``key``."""
    return _GROUPS[key]
