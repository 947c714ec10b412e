"""Differentiable gather of sequence shards of uneven length, for AutoSP's multimodal wrappers
(``autosp_vit``, ``autosp_fusion``).

Each rank of a sequence-parallel group holds a contiguous piece of a sequence (rank order = sequence order);
``gather_sequence`` returns the whole sequence on every rank. Pieces may differ in length (e.g. 5 patches on 2
ranks: 3 and 2): the lengths travel first, pieces are zero-padded to the longest for the all-gather and trimmed
after, so the result holds exactly the real tokens. The backward sums the gradient of the whole sequence over the
group (every rank's computation may have used every piece) and hands each rank the rows of its own piece.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import deepspeed.comm as dist


def shard_lengths(length: int, group: Any, device: torch.device) -> list[int]:
    """Every group rank's ``length``, in rank order."""
    mine = torch.tensor([length], dtype=torch.long, device=device)
    lengths = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, mine, group=group)
    return [int(t.item()) for t in lengths]


def _gather_padded(x: torch.Tensor, dim: int, lengths: list[int], group: Any) -> torch.Tensor:
    longest = max(lengths)
    pad = longest - x.shape[dim]
    if pad:
        x = F.pad(x.movedim(dim, -1), (0, pad)).movedim(-1, dim)
    parts = [torch.empty_like(x) for _ in lengths]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, lengths, strict=True)], dim=dim)


class _GatherSequence(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, lengths: list[int]) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.lengths = dim, group, lengths
        return _gather_padded(x, dim, lengths, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        start = sum(ctx.lengths[:rank])
        return grad.narrow(ctx.dim, start, ctx.lengths[rank]), None, None, None


def gather_sequence(x: torch.Tensor, group: Any, dim: int = 1,
                    lengths: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """The whole sequence (pieces of every rank of ``group`` concatenated along ``dim`` in rank order) and the
    length of each rank's piece. ``lengths`` (every rank's piece length) skips the length exchange when known."""
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"gather_sequence: dim={dim} is not a dimension of a {x.dim()}-D tensor")
    dim %= x.dim()
    if lengths is None:
        lengths = shard_lengths(x.shape[dim], group, x.device)
    elif len(lengths) != dist.get_world_size(group) or lengths[dist.get_rank(group)] != x.shape[dim]:
        raise ValueError(f"gather_sequence: lengths={lengths} must hold one entry per group rank, this rank's "
                         f"equal to its piece's length ({x.shape[dim]})")
    if dist.get_world_size(group) == 1:
        return x, lengths
    return _GatherSequence.apply(x, dim, group, lengths), lengths
