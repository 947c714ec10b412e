"""FPDT attention: Ulysses attention over sequence chunks, with finished chunks kept in host memory.

Input: this rank's tokens in FPDT order (``FPDT_InputConstruct``), ``[l, b, hidden]``, cut into ``num_chunks``
local chunks of ``c = l / num_chunks`` tokens. For chunk ``i`` every rank projects its tokens to q/k/v and one
all-to-all per tensor trades the sequence slices for a share of the heads, which reassembles global chunk ``i``
(``c * P`` tokens, in sequence order) for ``heads / P`` heads. Query chunk ``i`` attends to key chunks ``0..i``
(causally within ``i``), merged block by block by their log-sum-exps, and a last all-to-all returns the output
slice: ``[b, l, heads, head_dim]``, equal to full causal attention over the whole sequence.

With offloading, a chunk is loaded to the device only for the blocks that read it and released to its host copy
after them (``SequenceChunk``); without, every chunk stays resident. The backward pass walks key chunks in order,
each against the query chunks ``>= `` it, accumulating fp32 gradients of q (kept with the chunks), k and v; once
key chunk ``j`` is done the gradients of chunk ``j``'s q, k and v are complete, go back through the all-to-all and
the projection, and chunk ``j``'s input gradient and its share of the weight gradients are added.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from deepspeed.sequence.fpdt_kernels import (
    acc,
    apply_rotary_pos_emb_backward,
    block_attention_backward,
    block_attention_forward,
    update_out_and_lse,
)
from deepspeed.sequence.fpdt_offload import SequenceChunk
from deepspeed.sequence.layer import apply_rotary_pos_emb, sequence_all_to_all


class _Plan:
    """The static facts of one FPDT attention call: sizes, group, rotary tables, dropout seed."""

    def __init__(self, x: Tensor, spg: Any, sizes: tuple[int, int, int], num_chunks: int, rotary: Any,
                 dropout: float, offload: bool) -> None:
        self.projection_size, self.head_dim, self.kv_projection_size = sizes
        if num_chunks < 1 or x.shape[0] % num_chunks:
            raise ValueError(f"FPDT attention: the local sequence length ({x.shape[0]}) must be a positive multiple "
                             f"of num_chunks ({num_chunks})")
        if self.projection_size % self.head_dim or self.kv_projection_size % self.head_dim:
            raise ValueError(f"FPDT attention: projection_size ({self.projection_size}) and kv_projection_size "
                             f"({self.kv_projection_size}) must be multiples of the head size ({self.head_dim})")
        self.spg, self.world = spg, dist.get_world_size(spg)
        for name, size in (("query", self.projection_size), ("key/value", self.kv_projection_size)):
            if (size // self.head_dim) % self.world:
                raise ValueError(f"FPDT attention: the {name} head count ({size // self.head_dim}) must be divisible "
                                 f"by the sequence parallel size ({self.world})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"FPDT attention: dropout must be in [0, 1), got {dropout}")
        self.num_chunks, self.chunk = num_chunks, x.shape[0] // num_chunks
        self.scale = self.head_dim ** -0.5
        self.dropout, self.offload, self.dtype = float(dropout), offload, x.dtype
        self.cos = self.sin = None
        if rotary is not None:  # DeepSpeed's layout: [L, b, 1, rot] each, used as [b, L, 1, rot]
            self.cos, self.sin = (t.permute(1, 0, 2, 3) for t in rotary)
        self.seed = 0
        if self.dropout > 0:  # one draw from the default generator; blocks (and ranks) derive their own masks
            self.seed = int(torch.randint(2 ** 40, (1,)).item()) + dist.get_rank(spg) * (2 ** 41)

    def rope(self, i: int) -> tuple[Tensor, Tensor] | None:
        span = self.chunk * self.world
        if self.cos is None:
            return None
        return self.cos[:, span * i:span * (i + 1)], self.sin[:, span * i:span * (i + 1)]

    def block_seed(self, i: int, j: int) -> int:
        return self.seed + i * self.num_chunks + j


def _project(x_chunk: Tensor, weight: Tensor, bias: Tensor | None, plan: _Plan) -> list[Tensor]:
    """This rank's ``[c, b, hidden]`` tokens -> q, k, v ``[b, c*P, heads/P, head_dim]`` of the global chunk."""
    qkv = torch.matmul(x_chunk, weight.t())
    if bias is not None:
        qkv = qkv + bias
    p, kv = plan.projection_size, plan.kv_projection_size
    parts = (qkv[..., :p], qkv[..., p:p + kv], qkv[..., p + kv:])
    return [sequence_all_to_all(t.unflatten(-1, (-1, plan.head_dim)).transpose(0, 1).contiguous(), 1, plan.spg,
                                True) for t in parts]


def _to_local(t: Tensor, plan: _Plan) -> Tensor:
    """``[b, c*P, heads/P, d]`` -> this rank's ``[b, c, heads, d]``."""
    return sequence_all_to_all(t.contiguous(), 1, plan.spg, False)


def _chunk(t: Tensor, plan: _Plan, resident: bool) -> SequenceChunk:
    return SequenceChunk(t, is_in_use=resident or not plan.offload)


def _release(*chunks: SequenceChunk) -> None:
    for c in chunks:
        c.offload()


def _forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, plan: _Plan) -> Tensor:
    """Chunked attention; fills ``ctx.chunks`` with what the backward pass reads (when it will run)."""
    # grad mode is off inside Function.forward: whether a backward can come is told by the inputs alone
    save = any(t is not None and t.requires_grad for t in (x, weight, bias))
    qs, ks, vs, outs, lses, xs, final = [], [], [], [], [], [], []
    with torch.no_grad():
        for i in range(plan.num_chunks):
            x_i = x[i * plan.chunk:(i + 1) * plan.chunk]
            q, k, v = _project(x_i, weight, bias, plan)
            rope = plan.rope(i)
            if rope is not None:
                q, k = apply_rotary_pos_emb(q, *rope), apply_rotary_pos_emb(k, *rope)
            qs.append(_chunk(q, plan, True))
            ks.append(_chunk(k, plan, True))
            vs.append(_chunk(v, plan, True))
            out = lse = None
            for j in range(i + 1):
                block_out, block_lse = block_attention_forward(q, ks[j].use(), vs[j].use(), i == j, plan.scale,
                                                               plan.dropout, plan.block_seed(i, j))
                out, lse = update_out_and_lse(out, lse, block_out, block_lse)
                if plan.offload and j < i:
                    _release(ks[j], vs[j])
            if plan.offload:
                _release(qs[i], ks[i], vs[i])
            out = out.to(plan.dtype)
            final.append(_to_local(out, plan))
            if save:
                outs.append(_chunk(out, plan, False))
                lses.append(_chunk(lse[..., 0].transpose(1, 2).contiguous(), plan, False))
                xs.append(_chunk(x_i.detach(), plan, False))
    if save:
        ctx.plan, ctx.chunks = plan, (qs, ks, vs, outs, lses, xs)
        ctx.weight, ctx.bias = weight, bias
    return torch.cat(final, dim=1)


def _backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of the input, the fused qkv weight and its bias (None where not needed)."""
    plan, (qs, ks, vs, outs, lses, xs) = ctx.plan, ctx.chunks
    weight, bias = ctx.weight, ctx.bias
    n, c = plan.num_chunks, plan.chunk
    douts = [_chunk(sequence_all_to_all(grad_output[:, i * c:(i + 1) * c].contiguous(), 1, plan.spg, True), plan,
                    False) for i in range(n)]
    dqs = [None] * n
    grad_w = acc(torch.zeros_like(weight))
    grad_b = None if bias is None else acc(torch.zeros_like(bias))
    grad_x = []
    for j in range(n):
        k, v = ks[j].use(), vs[j].use()
        dk, dv = acc(torch.zeros_like(k)), acc(torch.zeros_like(v))
        for i in range(j, n):
            rows = (douts[i], qs[i], outs[i], lses[i])
            dq_blk, dk_blk, dv_blk = block_attention_backward(
                rows[0].use(), rows[1].use(), k, v, rows[2].use(), rows[3].use(), i == j, plan.scale, plan.dropout,
                plan.block_seed(i, j))
            dk.add_(dk_blk)
            dv.add_(dv_blk)
            if dqs[i] is None:
                dqs[i] = _chunk(dq_blk, plan, True)
            else:
                dqs[i].use().add_(dq_blk)
                dqs[i].overwrite_to_cpu()
            if plan.offload:
                _release(dqs[i], *rows)
        dq = dqs[j].use()
        dqs[j] = None
        if plan.offload:
            _release(ks[j], vs[j])
        grad_x.append(_project_backward(dq, dk, dv, xs[j].use(), weight, grad_w, grad_b, j, plan))
        if plan.offload:
            _release(xs[j])
    return torch.cat(grad_x, dim=0).to(plan.dtype), grad_w.to(weight.dtype), (
        None if grad_b is None else grad_b.to(bias.dtype))


def _project_backward(dq: Tensor, dk: Tensor, dv: Tensor, x_chunk: Tensor, weight: Tensor, grad_w: Tensor,
                      grad_b: Tensor | None, j: int, plan: _Plan) -> Tensor:
    """Chunk ``j``'s q/k/v gradients back through rotary, the all-to-all and the projection: adds the weight and
    bias gradients and returns the input gradient ``[c, b, hidden]`` (fp32)."""
    rope = plan.rope(j)
    if rope is not None:
        dq, dk = apply_rotary_pos_emb_backward(dq, *rope), apply_rotary_pos_emb_backward(dk, *rope)
    # the exchange carries the activations' dtype, as the forward pass did
    dqkv = torch.cat([_to_local(g.to(plan.dtype), plan).transpose(0, 1).flatten(2) for g in (dq, dk, dv)], dim=-1)
    dqkv = acc(dqkv)  # [c, b, projection + 2 * kv_projection]
    x32 = acc(x_chunk)
    grad_w.add_(torch.matmul(dqkv.flatten(0, 1).t(), x32.flatten(0, 1)))
    if grad_b is not None:
        grad_b.add_(dqkv.sum(dim=(0, 1)))
    return torch.matmul(dqkv, acc(weight))


def _fpdt_args(layernorm_output: Tensor, attention_mask: Any, inference_params: Any, rotary_pos_emb: Any, spg: Any,
               scatter_idx: int, gather_idx: int, hidden_size: int, projection_size: int,
               hidden_size_per_attention_head: int, kv_projection_size: int, qkv_linear_weight: Tensor,
               qkv_linear_bias: Tensor | None, dropout: float, num_chunks: int = 8,
               cpu_offloading: bool = True) -> dict[str, Any]:
    """DeepSpeed's argument list of both attention functions, by name. ``inference_params``, ``hidden_size`` and
    ``cpu_offloading`` are accepted and unused (the function class decides about offloading)."""
    return dict(locals())


def _function_forward(offload: bool, ctx: Any, args: tuple, kwargs: dict) -> Tensor:
    a = _fpdt_args(*args, **kwargs)
    x, scatter_idx, gather_idx = a["layernorm_output"], a["scatter_idx"], a["gather_idx"]
    if a["attention_mask"] is not None:
        raise ValueError("FPDT attention is causal over the whole sequence; attention_mask must be None")
    if scatter_idx < 2 or gather_idx >= 2:
        raise ValueError(f"FPDT attention: scatter_idx must be the heads dim (2) and gather_idx a sequence dim "
                         f"(0 or 1), got scatter_idx={scatter_idx}, gather_idx={gather_idx}")
    if x.dim() != 3:
        raise ValueError(f"FPDT attention: layernorm_output must be [local_seq, batch, hidden], got shape "
                         f"{tuple(x.shape)}")
    sizes = (a["projection_size"], a["hidden_size_per_attention_head"], a["kv_projection_size"])
    plan = _Plan(x, a["spg"], sizes, a["num_chunks"], a["rotary_pos_emb"], a["dropout"], offload)
    ctx.num_inputs = len(args)  # autograd wants one gradient per positional input
    return _forward(ctx, x, a["qkv_linear_weight"], a["qkv_linear_bias"], plan)


def _function_backward(ctx: Any, grad_output: Tensor) -> tuple[Any, ...]:
    if not hasattr(ctx, "chunks"):
        raise RuntimeError("FPDT attention: backward after a forward that saved nothing (grad mode was off)")
    # ctx.chunks stays (a retained graph may run backward again); the host copies go with the graph
    grad_x, grad_w, grad_b = _backward(ctx, grad_output)
    grads = [grad_x] + [None] * 10 + [grad_w, grad_b] + [None] * 3
    return tuple(grads[:ctx.num_inputs])


class _FPDTGPUAttentionImpl_(torch.autograd.Function):
    """FPDT attention with every chunk resident on the device: ``apply(layernorm_output [l, b, hidden],
    attention_mask (None), inference_params, rotary_pos_emb, spg, scatter_idx (2), gather_idx (0), hidden_size,
    projection_size, head_size, kv_projection_size, qkv_weight, qkv_bias, dropout, num_chunks=8,
    cpu_offloading=True)`` -> ``[b, l, heads, head_size]`` (DeepSpeed's order)."""

    @staticmethod
    def forward(ctx: Any, *args: Any, **kwargs: Any) -> Tensor:
        return _function_forward(False, ctx, args, kwargs)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Any, ...]:
        return _function_backward(ctx, grad_output)


class _FPDTGPUOffloadingAttentionImpl_(torch.autograd.Function):
    """FPDT attention keeping finished chunks in host memory and loading each only for the blocks that read it;
    same arguments as ``_FPDTGPUAttentionImpl_``."""

    @staticmethod
    def forward(ctx: Any, *args: Any, **kwargs: Any) -> Tensor:
        return _function_forward(True, ctx, args, kwargs)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Any, ...]:
        return _function_backward(ctx, grad_output)
