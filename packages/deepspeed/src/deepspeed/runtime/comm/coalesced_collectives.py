"""``deepspeed.runtime.comm.coalesced_collectives``: several tensors reduce-scattered in one collective, and ZeRO++'s
quantized gradient reduction (qgZ) for a list of tensors.

Partitioning, as DeepSpeed's: a tensor of ``n`` elements over ``W`` ranks is cut into ``ceil(n / W)``-element
slices, rank ``r`` owning elements ``[r * p, min((r + 1) * p, n))`` (the last owners may get fewer, or none).
Results are averaged over the ranks (the inputs are divided by ``W`` before the sum, as DeepSpeed does).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from deepspeed.utils import logger


def reduce_scatter_coalesced(tensors: list[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    """This rank's slice of the average of each tensor over ``group``, all tensors in one reduce-scatter."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    slices = [math.ceil(t.numel() / world) for t in tensors]
    pieces = []
    for owner in range(world):  # the buffer is rank-major: owner r's slices of every tensor, padded, back to back
        for t, width in zip(tensors, slices, strict=True):
            flat = t.detach().reshape(-1)
            piece = flat[owner * width:(owner + 1) * width]
            pieces.append(piece)
            if piece.numel() < width:
                pieces.append(flat.new_zeros(width - piece.numel()))
    buffer = torch.cat(pieces).div_(world)
    mine = buffer.new_empty(sum(slices))
    dist.reduce_scatter_tensor(mine, buffer, group=group)
    out, offset = [], 0
    for t, width in zip(tensors, slices, strict=True):
        owned = max(0, min(width, t.numel() - rank * width))
        out.append(mine.narrow(0, offset, owned))
        offset += width
    return out


def _ranks_per_node(world: int) -> int:
    from deepspeed.accelerator import get_accelerator

    local = get_accelerator().device_count() or world
    return local if 0 < local <= world and world % local == 0 else world


def all_to_all_quant_reduce(tensors: list[torch.Tensor], groups: dict[str, Any]) -> list[torch.Tensor]:
    """ZeRO++ qgZ: each tensor's average over the world, this rank's ``1 / W`` of it, exchanged as int8 codes in
    a hierarchical all-to-all (within the node, then across nodes; ds-zero's ``QuantizedReduce``). A 1-D tensor,
    or one whose size is not a multiple of ``2 W``, goes through ``reduce_scatter_coalesced`` unquantized, as in
    DeepSpeed. ``groups`` (DeepSpeed's node groups) is accepted; the node layout comes from the accelerator."""
    import deepspeed.comm as ds_comm
    from ds_zero.zeropp.groups import sub_group
    from ds_zero.zeropp.qgz import QuantizedReduce

    world = dist.get_world_size()
    out: list[torch.Tensor] = []
    reducer = None
    for t in tensors:
        if t.dim() == 1 or t.numel() % (2 * world) != 0:
            if t.dim() != 1:
                logger.warning(f"all_to_all_quant_reduce: {t.numel()} elements are not a multiple of 2 x world "
                               f"size ({world}); reduced unquantized")
            out.append(reduce_scatter_coalesced([t])[0])
            continue
        if reducer is None:
            node = _ranks_per_node(world)
            reducer = QuantizedReduce(sub_group(None, world, node, "block"), sub_group(None, world, node, "across"),
                                      ds_comm, block=2048)
        out.append((reducer.reduce(t.detach().reshape(world, -1)) / world).reshape(-1))
    return out


__all__ = ["all_to_all_quant_reduce", "reduce_scatter_coalesced"]
