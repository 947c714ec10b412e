"""How one dimension of a weight is cut into tensor-parallel shards, and how shards go back to a full tensor.

A dimension may hold packed sub-parameters (fused QKV, gate/up): each one is split on its own and a rank's
shard is the concatenation of its pieces, so every rank keeps whole Q, K and V heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ds_inference.autotp._comm import all_gather_uneven


@dataclass(frozen=True)
class ShardMeta:
    """Model facts the split depends on: key/value head count (attention splits keep whole heads) and the
    granularity in elements of the other splits (``tp_grain_size``)."""

    tp_size: int
    num_kv_heads: int | None = None
    tp_grain_size: int = 64


def shard_sizes(total: int, meta: ShardMeta, *, by_heads: bool) -> list[int]:
    """Per-rank sizes of a ``total``-long dimension: whole kv heads for attention widths (``by_heads``; with fewer
    heads than ranks the trailing ranks get none, their row-parallel share of the output is zero), else multiples
    of ``tp_grain_size`` (the remainder goes to the last rank), near-even when too small."""
    tp = meta.tp_size
    heads = meta.num_kv_heads
    if by_heads and heads and total % heads == 0:
        per_rank = [heads // tp + (1 if r < heads % tp else 0) for r in range(tp)]
        return [total * n // heads for n in per_rank]
    grain = meta.tp_grain_size
    units, rest = divmod(total, grain)
    if units >= tp:
        sizes = [(units // tp + (1 if r < units % tp else 0)) * grain for r in range(tp)]
        sizes[-1] += rest
        return sizes
    if total < tp:
        raise ValueError(f"cannot shard a dimension of {total} over tp_size={tp}")
    return [total // tp + (1 if r < total % tp else 0) for r in range(tp)]


@dataclass(frozen=True)
class ShardLayout:
    """Where each rank's shard comes from: ``pieces[rank]`` lists ``(start, length)`` ranges of the full dim."""

    full: int
    pieces: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def sizes(self) -> list[int]:
        return [sum(length for _, length in ranks) for ranks in self.pieces]

    def take(self, full: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
        """This rank's shard of the full tensor (a copy)."""
        if full.shape[dim] != self.full:
            raise ValueError(f"expected {self.full} entries along dim {dim}, got shape {tuple(full.shape)}")
        parts = [full.narrow(dim, start, length) for start, length in self.pieces[rank]]
        return torch.cat(parts, dim=dim).clone().contiguous()

    def gather(self, local: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The full tensor, assembled on every rank from all shards."""
        gathered = all_gather_uneven(local, self.sizes, dim, group)
        order = torch.empty(self.full, dtype=torch.long)
        cursor = 0
        for ranks in self.pieces:
            for start, length in ranks:
                order[start:start + length] = torch.arange(cursor, cursor + length)
                cursor += length
        return gathered.index_select(dim % local.dim(), order.to(local.device))


def make_layout(sub_sizes: Sequence[int], meta: ShardMeta, *, by_heads: bool) -> ShardLayout:
    """Layout of a dimension packing ``sub_sizes`` sub-parameters back to back, each split over the ranks."""
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(meta.tp_size)]
    start = 0
    for sub in sub_sizes:
        offset = start
        for rank, size in enumerate(shard_sizes(sub, meta, by_heads=by_heads)):
            pieces[rank].append((offset, size))
            offset += size
        start += sub
    return ShardLayout(full=start, pieces=tuple(tuple(p) for p in pieces))
