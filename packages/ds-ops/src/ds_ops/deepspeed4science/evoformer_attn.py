"""Evoformer attention (DeepSpeed4Science): ``softmax(Q K^T / sqrt(d) + bias1 + bias2) V`` over the rows of an
MSA / pair representation, with a mask bias per row and a pair bias shared by the rows.

Shapes (DeepSpeed's): ``Q, K, V`` are ``[B, N, L, H, D]`` (batch, rows, sequence, heads, head dim); ``bias1`` is
``[B, N, 1, 1, L]`` (typically ``1e9 * (mask - 1)``), ``bias2`` is ``[B, 1, H, L, L]``. Either bias may be
left out. The output has ``Q``'s shape and dtype.

DeepSpeed runs this on a CUTLASS CUDA kernel (``EvoformerAttnBuilder``), which this version does not ship; here it
is torch on any device, with the kernel's memory behaviour: the ``L x L`` scores exist only for a slice of rows
at a time, softmax runs in fp32, and backward recomputes the probabilities from the saved log-sum-exp instead of
keeping them (saved: Q, K, V, the output and a ``[B, N, H, L]`` log-sum-exp, fp32 or
fp64 for fp64 inputs).
"""

from __future__ import annotations

import math

import torch

# Bytes of fp32 scores one slice of rows may hold (the L x L temporaries of forward and backward).
SCORE_BUDGET_BYTES = 64 * 2**20


def _rows_per_slice(q: torch.Tensor) -> int:
    batch, rows, heads, length = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    return max(1, min(rows, SCORE_BUDGET_BYTES // max(1, 4 * batch * heads * length * length)))


def _scores(q, k, bias1, bias2, rows: slice, scale: float) -> torch.Tensor:
    """Scores of rows ``rows``: ``[B, n, H, L, L]`` (q, k already ``[B, N, H, L, D]`` in the compute dtype)."""
    s = torch.matmul(q[:, rows], k[:, rows].transpose(-1, -2)) * scale
    if bias1 is not None:
        s = s + bias1[:, rows].to(s.dtype)
    if bias2 is not None:
        s = s + bias2.to(s.dtype)
    return s


class EvoformerFusedAttention(torch.autograd.Function):
    """The attention with its own backward (gradients for Q, K, V and both biases); inputs ``[B, N, L, H, D]``."""

    @staticmethod
    def forward(ctx, q, k, v, bias1=None, bias2=None):
        scale = 1.0 / math.sqrt(q.shape[-1])
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32 softmax for half inputs, fp64 stays fp64
        qf, kf, vf = (t.transpose(-2, -3).to(acc) for t in (q, k, v))  # [B, N, H, L, D]
        out = torch.empty_like(qf)
        lse = torch.empty(qf.shape[:-1], dtype=acc, device=q.device)
        step = _rows_per_slice(qf)
        for start in range(0, qf.shape[1], step):
            rows = slice(start, start + step)
            s = _scores(qf, kf, bias1, bias2, rows, scale)
            lse[:, rows] = torch.logsumexp(s, dim=-1)
            out[:, rows] = torch.matmul(torch.exp(s - lse[:, rows, ..., None]), vf[:, rows])
        out = out.transpose(-2, -3).to(q.dtype)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, out, lse, bias1, bias2)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, bias1, bias2 = ctx.saved_tensors
        qf, kf, vf, of, gf = (t.transpose(-2, -3).to(lse.dtype) for t in (q, k, v, out, grad_out))
        delta = (gf * of).sum(-1)  # [B, N, H, L]: rowsum(dP * P) without P
        dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
        want_b1 = bias1 is not None and ctx.needs_input_grad[3]
        want_b2 = bias2 is not None and ctx.needs_input_grad[4]
        db1 = torch.empty(bias1.shape, dtype=lse.dtype, device=q.device) if want_b1 else None
        db2 = torch.zeros(bias2.shape, dtype=lse.dtype, device=q.device) if want_b2 else None
        step = _rows_per_slice(qf)
        for start in range(0, qf.shape[1], step):
            rows = slice(start, start + step)
            p = torch.exp(_scores(qf, kf, bias1, bias2, rows, ctx.scale) - lse[:, rows, ..., None])
            dv[:, rows] = torch.matmul(p.transpose(-1, -2), gf[:, rows])
            ds = p * (torch.matmul(gf[:, rows], vf[:, rows].transpose(-1, -2)) - delta[:, rows, ..., None])
            dq[:, rows] = torch.matmul(ds, kf[:, rows]) * ctx.scale
            dk[:, rows] = torch.matmul(ds.transpose(-1, -2), qf[:, rows]) * ctx.scale
            if want_b1:
                db1[:, rows] = ds.sum(dim=(2, 3), keepdim=True)
            if want_b2:
                db2 += ds.sum(dim=1, keepdim=True)
        grads = [g.transpose(-2, -3).to(t.dtype) for g, t in ((dq, q), (dk, k), (dv, v))]
        return (*grads, db1.to(bias1.dtype) if want_b1 else None, db2.to(bias2.dtype) if want_b2 else None)


def DS4Sci_EvoformerAttention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,  # noqa: N802, N803 - DeepSpeed's
                              biases: list[torch.Tensor | None]) -> torch.Tensor:
    """Evoformer attention of ``Q, K, V`` (``[B, N, L, H, D]``) with up to two biases: ``biases[0]`` of shape
    ``[B, N, 1, 1, L]``, ``biases[1]`` of shape ``[B, 1, H, L, L]`` (None or absent: no bias)."""
    if Q.dim() != 5 or K.shape != Q.shape or V.shape != Q.shape:
        raise ValueError(f"DS4Sci_EvoformerAttention: Q, K and V must share one [B, N, L, H, D] shape; got "
                         f"Q {tuple(Q.shape)}, K {tuple(K.shape)}, V {tuple(V.shape)}")
    if len(biases) > 2:
        raise ValueError(f"DS4Sci_EvoformerAttention takes at most 2 biases ([B, N, 1, 1, L] and [B, 1, H, L, L]); "
                         f"got {len(biases)}")
    batch, rows, length, heads, _ = Q.shape
    padded = [*biases, None, None][:2]
    expected = [(batch, rows, 1, 1, length), (batch, 1, heads, length, length)]
    for i, (bias, shape) in enumerate(zip(padded, expected, strict=True)):
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(f"DS4Sci_EvoformerAttention: biases[{i}] has shape {tuple(bias.shape)}; for Q of shape "
                             f"{tuple(Q.shape)} it must be {shape}")
    return EvoformerFusedAttention.apply(Q, K, V, padded[0], padded[1])
