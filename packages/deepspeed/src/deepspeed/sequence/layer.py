"""DeepSpeed-Ulysses: attention over a sequence sharded across a process group.

``DistributedAttention`` wraps any attention callable ``local_attention(q, k, v, *args, **kwargs)``. Its inputs
are sequence shards, ``[s/P, b, h, d]`` (``batch_dim_idx=1``) or ``[b, s/P, h, d]`` (``batch_dim_idx=0``). An
all-to-all over the sequence group scatters the heads and gathers the sequence, so the local attention sees the
full sequence for its share of the heads; a second all-to-all sends the result back to the input's layout. The
exchange is differentiable: its gradient is the same exchange run the other way.

Layout rule (DeepSpeed's): the layout comes from ``batch_dim_idx`` alone (sequence on dim ``1 - batch_dim_idx``,
heads on dim 2), and ``scatter_idx`` only says the direction: ``scatter_idx < 2`` scatters the sequence and
gathers the heads, anything else scatters the heads and gathers the sequence. ``gather_idx`` is the direction
of the way back, so it does not relabel the batch dimension: ``scatter_idx=2, gather_idx=1`` with
``[b, s/P, h, d]`` and ``batch_dim_idx=0`` gathers the sequence, as in DeepSpeed.

Heads are dealt by key/value group (``_HeadPartition``): with ``num_kv_heads`` (default: the key's head count)
divisible by the group size every rank gets an equal contiguous block; otherwise the first ``num_kv_heads % P``
ranks get one key/value head more, and each query head goes with its key/value group (GQA), as DeepSpeed's
uneven-head path does.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from deepspeed import comm
from deepspeed.accelerator import get_accelerator

# torchembed's fused RoPE kernel (Triton), which DeepSpeed uses for tensors on an accelerator when installed. It is
# imported at its first use, not with this module: an optional package nothing declares must not load on import.
_torchembed_available = importlib.util.find_spec("torchembed") is not None
_torchembed_rope_forward = None


def _fused_rope_forward():
    """torchembed's ``fused_rope_forward``, or None when it does not import (then the flag turns False)."""
    global _torchembed_available, _torchembed_rope_forward
    if _torchembed_rope_forward is None and _torchembed_available:
        try:
            from torchembed._triton import fused_rope_forward
        except ImportError:
            _torchembed_available = False
        else:
            _torchembed_rope_forward = fused_rope_forward
    return _torchembed_rope_forward


class _HeadPartition:
    """Which ranks hold which heads: contiguous blocks of key/value groups over ``world`` ranks."""

    def __init__(self, kv_heads: int, world: int) -> None:
        if kv_heads < world:
            raise ValueError(f"DistributedAttention: num_kv_heads ({kv_heads}) must be at least the sequence "
                             f"parallel size ({world}); a smaller count leaves a rank with no head to attend over")
        self.kv_heads, self.world = kv_heads, world
        self.even = kv_heads % world == 0
        self.kv_counts = [kv_heads // world + (1 if r < kv_heads % world else 0) for r in range(world)]

    def counts(self, heads: int, name: str) -> list[int]:
        """Heads per rank for a tensor of ``heads`` heads in all."""
        if self.even:
            if heads % self.world != 0:
                raise ValueError(f"DistributedAttention: the number of heads of {name} ({heads}) must be divisible "
                                 f"by the sequence parallel size ({self.world}) when num_kv_heads "
                                 f"({self.kv_heads}) is")
            return [heads // self.world] * self.world
        if heads % self.kv_heads != 0:
            raise ValueError(f"DistributedAttention: the number of heads of {name} ({heads}) must be a multiple of "
                             f"num_kv_heads ({self.kv_heads}) to split {self.kv_heads} key/value heads unevenly "
                             f"over {self.world} ranks")
        return [heads * c // self.kv_heads for c in self.kv_counts]

    def total(self, local: int, rank: int, name: str) -> int:
        """The head count over all ranks of a tensor whose shard on ``rank`` holds ``local`` heads."""
        if self.even:
            return local * self.world
        share = self.kv_counts[rank]
        if (local * self.kv_heads) % share != 0:
            raise ValueError(f"DistributedAttention: {name} holds {local} heads on rank {rank}, which is not a "
                             f"whole number of heads per key/value group for its {share} of num_kv_heads="
                             f"{self.kv_heads}")
        return local * self.kv_heads // share


def _splits(counts: list[int]) -> list[int] | None:
    return None if len(set(counts)) == 1 else counts


def _to_heads(x: Tensor, seq_dim: int, counts: list[int], group: Any) -> Tensor:
    """``[.., s/P, .., H, d]`` -> ``[.., s, .., counts[rank], d]``: rank r receives heads of block r of
    every rank's sequence chunk, and concatenates the chunks in rank order."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    send = x.movedim(2, 0).contiguous()  # [H, d0, d1, d]: one block of heads per destination
    recv = send.new_empty((world * counts[rank],) + tuple(send.shape[1:]))
    splits = _splits(counts)
    comm.all_to_all_single(recv, send, output_split_sizes=None if splits is None else [counts[rank]] * world,
                           input_split_sizes=splits, group=group)
    recv = recv.unflatten(0, (world, counts[rank])).movedim(1, 3)  # [P(source), d0, d1, n, d]
    return recv.movedim(0, seq_dim).flatten(seq_dim, seq_dim + 1)


def _to_sequence(x: Tensor, seq_dim: int, counts: list[int], group: Any) -> Tensor:
    """``[.., s, .., counts[rank], d]`` -> ``[.., s/P, .., H, d]``: the inverse of ``_to_heads``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    seq = x.shape[seq_dim]
    if seq % world != 0:
        raise ValueError(f"DistributedAttention: the sequence length ({seq}, dim {seq_dim} of a {tuple(x.shape)} "
                         f"tensor) must be divisible by the sequence parallel size ({world})")
    chunks = x.unflatten(seq_dim, (world, seq // world)).movedim(seq_dim, 0)  # [P(destination), d0, d1, n, d]
    send = chunks.movedim(3, 1).contiguous().flatten(0, 1)
    recv = send.new_empty((sum(counts),) + tuple(send.shape[1:]))
    splits = _splits(counts)
    comm.all_to_all_single(recv, send, output_split_sizes=splits,
                           input_split_sizes=None if splits is None else [counts[rank]] * world, group=group)
    return recv.movedim(0, 2)


class _SeqAllToAll(torch.autograd.Function):
    """The differentiable exchange; the backward pass exchanges the gradient the opposite way."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: Tensor, seq_dim: int, counts: list[int], to_heads: bool) -> Tensor:
        ctx.args = (seq_dim, counts, group)
        ctx.to_heads = to_heads
        if dist.get_world_size(group) == 1:
            return x
        return (_to_heads if to_heads else _to_sequence)(x, seq_dim, counts, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        seq_dim, counts, group = ctx.args
        return None, _SeqAllToAll.apply(group, grad, seq_dim, counts, not ctx.to_heads), None, None, None


def sequence_all_to_all(x: Tensor, seq_dim: int, group: Any, to_heads: bool) -> Tensor:
    """The differentiable Ulysses exchange with the heads (dim 2) split evenly over ``group``: ``to_heads``
    turns ``[.., s/P, .., H, d]`` into ``[.., s, .., H/P, d]``, otherwise the reverse (ALST's HF attention uses it)."""
    world = dist.get_world_size(group)
    heads = x.shape[2]
    if to_heads and heads % world:
        raise ValueError(f"sequence_all_to_all: the head count ({heads}, dim 2 of a {tuple(x.shape)} tensor) must "
                         f"be divisible by the sequence parallel size ({world})")
    counts = [heads // world if to_heads else heads] * world
    return _SeqAllToAll.apply(group, x, seq_dim, counts, to_heads)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.unflatten(-1, (2, x.shape[-1] // 2)).unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Rotary position embedding on the first ``freqs_cos.shape[-1]`` features of ``t`` (broadcast shapes)."""
    rot_dim = freqs_cos.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    # The fused kernel takes [seq, rot_dim] caches applied along t's second-to-last axis: used only when t's dim 0
    # is unambiguously the caches' sequence dim (callers with another layout take the reference formula).
    fused = None
    if (_torchembed_available and get_accelerator().on_accelerator(t) and rot_dim % 2 == 0
            and freqs_cos.shape[0] == t.shape[0] and freqs_cos.numel() == freqs_cos.shape[0] * rot_dim):
        fused = _fused_rope_forward()
    if fused is not None:
        cos, sin = (f.reshape(f.shape[0], rot_dim) for f in (freqs_cos, freqs_sin))
        seq_last = t.movedim(0, -2).contiguous()
        out, _ = fused(seq_last, seq_last, cos, sin)
        t = out.movedim(-2, 0).contiguous()
    else:
        t = t * freqs_cos + _rotate_half(t) * freqs_sin
    return t if t_pass.shape[-1] == 0 else torch.cat((t, t_pass), dim=-1)


class DistributedAttention(Module):
    """Ulysses attention: all-to-all around ``local_attention`` over ``sequence_process_group``.

    ``num_kv_heads``: the key/value head count the heads are dealt by (see the module docstring); default: the
    key's head count at each call. ``sp_stream`` is accepted for DeepSpeed compatibility (it overlaps the q/k/v
    exchanges with compute on CUDA); here every exchange runs on the current stream, which gives the same results.
    """

    def __init__(self, local_attention: Module, sequence_process_group: Any, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None, num_kv_heads: int | None = None) -> None:
        super().__init__()
        if (scatter_idx < 2) == (gather_idx < 2):
            raise ValueError(f"DistributedAttention: one of scatter_idx ({scatter_idx}) and gather_idx "
                             f"({gather_idx}) must be the heads dim (2) and the other a sequence dim (0 or 1): "
                             f"with both on one side the way back would not undo the first exchange")
        if num_kv_heads is not None and (isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int)
                                         or num_kv_heads < 1):
            raise ValueError(f"DistributedAttention: num_kv_heads must be a positive integer or None, "
                             f"got {num_kv_heads!r}")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads
        self.sp_overlap_comm = False

    def layer_sync(self, layer: Any) -> None:
        """A no-op: communication is not overlapped (see the class docstring)."""

    @staticmethod
    def _check(tensors: dict[str, Tensor], batch_dim_idx: int) -> int:
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"DistributedAttention: batch_dim_idx must be 0 ([b, s, h, d]) or 1 ([s, b, h, d]), "
                             f"got {batch_dim_idx}")
        for name, t in tensors.items():
            if t.dim() != 4:
                raise ValueError(f"DistributedAttention: {name} has shape {tuple(t.shape)}; expected 4 dims "
                                 f"([s/P, b, h, d] or [b, s/P, h, d])")
        return 1 - batch_dim_idx

    def _counts(self, tensors: dict[str, Tensor], heads_first: bool) -> tuple[_HeadPartition, list[list[int]]]:
        """The partition and each tensor's heads per rank, from shapes alone (before any rank communicates)."""
        world, rank = dist.get_world_size(self.spg), dist.get_rank(self.spg)
        if heads_first:  # the inputs hold every head
            part = _HeadPartition(self.num_kv_heads or tensors["key"].shape[2], world)
            return part, [part.counts(t.shape[2], name) for name, t in tensors.items()]
        # the inputs hold this rank's heads over the full sequence
        part = _HeadPartition(self.num_kv_heads or tensors["key"].shape[2] * world, world)
        return part, [part.counts(part.total(t.shape[2], rank, name), name) for name, t in tensors.items()]

    def forward(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int, rotary_pos_emb: Any = None,
                *args: Any, **kwargs: Any) -> Tensor:
        """Attention of local sequence shards; returns the local shard of the output, in the input's layout.

        ``rotary_pos_emb``: optional ``(cos, sin)``, each ``[b, s, 1, rot_dim]`` over the full sequence, applied
        to query and key after the exchange (permuted to ``[s, b, 1, rot_dim]`` for ``batch_dim_idx=1``, as
        DeepSpeed does; used as given for ``batch_dim_idx=0``, where DeepSpeed's permute would not broadcast).
        ``args``/``kwargs`` go to ``local_attention``.
        """
        tensors = {"query": query, "key": key, "value": value}
        seq_dim = self._check(tensors, batch_dim_idx)
        heads_first = not self.scatter_idx < 2
        part, counts = self._counts(tensors, heads_first)
        q, k, v = (_SeqAllToAll.apply(self.spg, t, seq_dim, c, heads_first)
                   for t, c in zip(tensors.values(), counts, strict=True))
        if rotary_pos_emb is not None:
            cos, sin = rotary_pos_emb
            if batch_dim_idx == 1:
                cos, sin = cos.permute(1, 0, 2, 3), sin.permute(1, 0, 2, 3)
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        self._check({"the attention output": context}, batch_dim_idx)
        if heads_first:
            rank = dist.get_rank(self.spg)
            out_counts = part.counts(part.total(context.shape[2], rank, "the attention output"), "the output")
        else:
            out_counts = part.counts(context.shape[2], "the attention output")
        return _SeqAllToAll.apply(self.spg, context, seq_dim, out_counts, not heads_first)
