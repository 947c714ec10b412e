"""DeepSpeed-Ulysses: attention over a sequence sharded across a process group.

``DistributedAttention`` wraps any attention callable ``local_attention(q, k, v, *args, **kwargs)``. Its inputs
are sequence shards, ``[s/P, b, h, d]`` (``batch_dim_idx=1``) or ``[b, s/P, h, d]`` (``batch_dim_idx=0``). An
all-to-all over the sequence group scatters the heads and gathers the sequence, so the local attention sees the
full sequence for ``h/P`` heads; a second all-to-all sends the result back to ``[s/P, ..., h, d]``. The
exchange is differentiable: its gradient is the same exchange with scatter and gather swapped.

``scatter_idx`` / ``gather_idx`` are dimensions of the sequence-first layout ``[s, b, h, d]``, as in DeepSpeed
(defaults: scatter the heads, dim 2; gather the sequence, dim 0); with ``batch_dim_idx=0`` dims 0 and 1 are read
swapped, so the defaults mean the same thing in either layout. Every rank must hold the same number of tokens,
and the head count must divide by the group size (DeepSpeed's uneven-head partition is not built).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from deepspeed import comm


def _exchange(x: Tensor, scatter_dim: int, gather_dim: int, group: Any) -> Tensor:
    """All-to-all: split ``x`` into P chunks along ``scatter_dim``, send chunk i to rank i, and concatenate
    the chunks received along ``gather_dim`` in rank order."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    size = x.shape[scatter_dim]
    if size % world != 0:
        raise ValueError(f"DistributedAttention: dimension {scatter_dim} of a {tuple(x.shape)} tensor ({size}) "
                         f"must be divisible by the sequence parallel size ({world})")
    send = x.unflatten(scatter_dim, (world, size // world)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=group)
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _SeqAllToAll(torch.autograd.Function):
    """The differentiable exchange; the backward pass exchanges the gradient the opposite way."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: Tensor, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None]:
        return None, _SeqAllToAll.apply(ctx.group, grad.contiguous(), ctx.gather_dim, ctx.scatter_dim), None, None


def _layout_dim(idx: int, batch_dim_idx: int) -> int:
    """A dimension of the sequence-first layout ``[s, b, h, d]`` in the tensor's own layout."""
    return 1 - idx if batch_dim_idx == 0 and idx in (0, 1) else idx


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.unflatten(-1, (2, x.shape[-1] // 2)).unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Rotary position embedding on the first ``freqs_cos.shape[-1]`` features of ``t`` (broadcast shapes)."""
    rot_dim = freqs_cos.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t = t * freqs_cos + _rotate_half(t) * freqs_sin
    return t if t_pass.shape[-1] == 0 else torch.cat((t, t_pass), dim=-1)


class DistributedAttention(Module):
    """Ulysses attention: all-to-all around ``local_attention`` over ``sequence_process_group``.

    ``sp_stream`` is accepted for DeepSpeed compatibility (it overlaps the q/k/v exchanges with compute on
    CUDA); here every exchange runs on the current stream, which gives the same results.
    """

    def __init__(self, local_attention: Module, sequence_process_group: Any, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None) -> None:
        super().__init__()
        if scatter_idx == gather_idx:
            raise ValueError(f"DistributedAttention: scatter_idx and gather_idx must differ (both {scatter_idx})")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.sp_overlap_comm = False

    def layer_sync(self, layer: Any) -> None:
        """A no-op: communication is not overlapped (see the class docstring)."""

    def _check(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int) -> tuple[int, int]:
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"DistributedAttention: batch_dim_idx must be 0 ([b, s, h, d]) or 1 ([s, b, h, d]), "
                             f"got {batch_dim_idx}")
        scatter = _layout_dim(self.scatter_idx, batch_dim_idx)
        gather = _layout_dim(self.gather_idx, batch_dim_idx)
        world = dist.get_world_size(self.spg)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() <= max(scatter, gather):
                raise ValueError(f"DistributedAttention: {name} has shape {tuple(t.shape)}; expected 4 dims "
                                 f"([s/P, b, h, d] or [b, s/P, h, d])")
            if t.shape[scatter] % world != 0:
                raise ValueError(f"DistributedAttention: the number of heads of {name} ({t.shape[scatter]}, dim "
                                 f"{scatter}) must be divisible by the sequence parallel size ({world})")
        return scatter, gather

    def forward(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int, rotary_pos_emb: Any = None,
                *args: Any, **kwargs: Any) -> Tensor:
        """Attention of local sequence shards; returns the local shard of the output, in the input's layout.

        ``rotary_pos_emb``: optional ``(cos, sin)``, each ``[b, s, 1, rot_dim]`` over the full sequence, applied
        to query and key after the exchange (permuted to ``[s, b, 1, rot_dim]`` for ``batch_dim_idx=1``, as
        DeepSpeed does; used as given for ``batch_dim_idx=0``, where DeepSpeed's permute would not broadcast).
        ``args``/``kwargs`` go to ``local_attention``.
        """
        scatter, gather = self._check(query, key, value, batch_dim_idx)
        q, k, v = (_SeqAllToAll.apply(self.spg, t, scatter, gather) for t in (query, key, value))
        if rotary_pos_emb is not None:
            cos, sin = rotary_pos_emb
            if batch_dim_idx == 1:
                cos, sin = cos.permute(1, 0, 2, 3), sin.permute(1, 0, 2, 3)
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return _SeqAllToAll.apply(self.spg, context, gather, scatter)
