"""AutoTP's tensor-parallel collectives as torch custom ops (namespace ``autotp``), so a compiled graph carries
them as nodes instead of the layers' ``autograd.Function`` calls (which Dynamo would trace through or break on).

- ``copy_to_tp_region`` (Megatron's *f*): identity forward, all-reduce of the gradient backward; it goes in
  front of a column-parallel matmul, whose input is replicated but whose input gradient is a partial sum.
- ``reduce_from_tp_region`` (*g*): all-reduce forward, identity backward; after a row-parallel matmul, whose
  output is a partial sum over the input-feature shards.
- ``gather_from_tp_region``: all-gather of the last dimension by the layer's frozen shard widths (uneven ones
  too), for a column layer with ``gather_output``; backward keeps this rank's slice of the gradient.

All three act on the tensor-parallel group of ``deepspeed.utils.groups`` (the one AutoTP partitioned over).
"""

from __future__ import annotations

import torch

import deepspeed.comm as dist
from deepspeed.utils import groups


def get_tp_group():
    """The tensor-parallel process group the model was partitioned over by AutoTP."""
    return groups.get_tensor_model_parallel_group()


@torch.library.custom_op("autotp::copy_to_tp_region", mutates_args=())
def copy_to_tp_region(input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - the op schema's argument name
    """Identity (a fresh tensor: a custom op's output may not alias its input)."""
    return input.clone()


@copy_to_tp_region.register_fake
def _copy_to_tp_region_fake(input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    return torch.empty_like(input)


@torch.library.custom_op("autotp::reduce_from_tp_region", mutates_args=())
def reduce_from_tp_region(input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """Sum of the ranks' partial results (an all-reduce over the tensor-parallel group)."""
    summed = input.contiguous().clone()
    dist.all_reduce(summed, group=get_tp_group())
    return summed


@reduce_from_tp_region.register_fake
def _reduce_from_tp_region_fake(input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    return torch.empty_like(input)


def _check_widths(width: int, partition_sizes: list[int], world: int, rank: int) -> None:
    if len(partition_sizes) != world:
        raise ValueError(f"gather_from_tp_region: partition_sizes={list(partition_sizes)} has {len(partition_sizes)} "
                         f"entries, the tensor-parallel group has {world} ranks")
    if width != partition_sizes[rank]:
        raise ValueError(f"gather_from_tp_region: rank {rank} holds a shard of width {width}, partition_sizes says "
                         f"{partition_sizes[rank]}")


@torch.library.custom_op("autotp::gather_from_tp_region", mutates_args=())
def gather_from_tp_region(input: torch.Tensor, partition_sizes: list[int]) -> torch.Tensor:  # noqa: A002
    """Concatenate the ranks' shards along the last dimension (rank order), shard ``r`` being
    ``partition_sizes[r]`` wide. Shards are padded to the widest one so a single all-gather carries them."""
    group = get_tp_group()
    world = dist.get_world_size(group=group)
    if world == 1:
        return input.clone()
    rank = dist.get_rank(group=group)
    _check_widths(input.shape[-1], partition_sizes, world, rank)
    widest = max(partition_sizes)
    padded = input.contiguous()
    if input.shape[-1] < widest:
        padded = torch.nn.functional.pad(padded, (0, widest - input.shape[-1]))
    # all_gather_into_tensor concatenates the ranks' tensors along dim 0
    stacked = padded.new_empty((world * padded.shape[0], *padded.shape[1:]))
    dist.all_gather_into_tensor(stacked, padded, group=group)
    per_rank = stacked.view(world, *padded.shape)
    return torch.cat([per_rank[r].narrow(-1, 0, w) for r, w in enumerate(partition_sizes)], dim=-1)


@gather_from_tp_region.register_fake
def _gather_from_tp_region_fake(input: torch.Tensor, partition_sizes: list[int]) -> torch.Tensor:  # noqa: A002
    return input.new_empty((*input.shape[:-1], sum(partition_sizes)))


def _no_context(ctx, inputs, output) -> None:
    pass


def _copy_to_tp_region_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    # f and g are duals: f's backward is g's forward
    return reduce_from_tp_region(grad.contiguous())


def _reduce_from_tp_region_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    return grad


def _gather_setup(ctx, inputs, output) -> None:
    ctx.partition_sizes = tuple(inputs[1])


def _gather_from_tp_region_backward(ctx, grad: torch.Tensor):
    group = get_tp_group()
    if dist.get_world_size(group=group) == 1:
        return grad, None
    sizes = ctx.partition_sizes
    rank = dist.get_rank(group=group)
    return grad.narrow(-1, sum(sizes[:rank]), sizes[rank]).contiguous(), None


copy_to_tp_region.register_autograd(_copy_to_tp_region_backward, setup_context=_no_context)
reduce_from_tp_region.register_autograd(_reduce_from_tp_region_backward, setup_context=_no_context)
gather_from_tp_region.register_autograd(_gather_from_tp_region_backward, setup_context=_gather_setup)
