"""FPDT's chunked feed-forward block and chunked vocabulary loss.

Both run over the local sequence ``[l, b, ...]`` a chunk of tokens at a time and recompute their intermediates
(the ``4h`` activations, the ``[chunk, b, vocab]`` logits) in the backward pass instead of storing them, which is
what keeps long sequences in memory: only the inputs are saved (the loss keeps its input in host memory).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


def bias_gelu(x: Tensor) -> Tensor:
    """GELU, tanh approximation (Megatron's ``bias_gelu`` after the bias is added)."""
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + _CUBIC * x * x * x)))


def bias_gelu_back(g: Tensor, x: Tensor) -> Tensor:
    """``g`` times the derivative of ``bias_gelu`` at ``x``."""
    inner = _SQRT_2_OVER_PI * (x + _CUBIC * x * x * x)
    t = torch.tanh(inner)
    d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * _CUBIC * x * x)
    return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner)


def _num_chunks(length: int, chunk_size: int, what: str) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1 or length % chunk_size:
        raise ValueError(f"{what}: the local sequence length ({length}) must be a multiple of a positive "
                         f"chunk_size, got chunk_size={chunk_size!r}")
    return length // chunk_size


class FPDT_FFN(torch.autograd.Function):
    """``gelu(x @ w1.T + b1) @ w2.T`` (``+ b2`` when ``add_bias``) over ``x [l, b, h]`` in chunks of
    ``chunk_size`` tokens. Returns ``(out, b2)`` when not ``add_bias`` (Megatron's return-bias convention: the
    caller adds it, and its gradient comes back through the second output), else ``(out, None)``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, add_bias: bool,
                chunk_size: int) -> tuple[Tensor, Tensor | None]:
        n = _num_chunks(x.shape[0], chunk_size, "FPDT_FFN")
        out = torch.empty(x.shape[:-1] + (w2.shape[0],), dtype=x.dtype, device=x.device)
        for i in range(n):
            rows = slice(i * chunk_size, (i + 1) * chunk_size)
            hidden = bias_gelu(torch.matmul(x[rows], w1.t()) + b1)
            out[rows] = torch.matmul(hidden, w2.t()) + b2 if add_bias else torch.matmul(hidden, w2.t())
        ctx.save_for_backward(x, w1, b1, w2, b2)
        ctx.add_bias, ctx.chunk_size = add_bias, chunk_size
        return out, (None if add_bias else b2.detach())

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, grad_bias: Tensor | None) -> tuple[Any, ...]:
        x, w1, b1, w2, b2 = ctx.saved_tensors
        size = ctx.chunk_size
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (w1, b1, w2, b2)]
        grad_w1, grad_b1, grad_w2, grad_b2 = grads
        grad_x = torch.empty_like(x)
        for i in range(x.shape[0] // size):
            rows = slice(i * size, (i + 1) * size)
            x_c, g = x[rows].float(), grad_out[rows].float()
            pre = torch.matmul(x_c, w1.float().t()) + b1.float()
            grad_w2.add_(torch.matmul(g.flatten(0, -2).t(), bias_gelu(pre).flatten(0, -2)))
            if ctx.add_bias:
                grad_b2.add_(g.sum(dim=tuple(range(g.dim() - 1))))
            grad_pre = bias_gelu_back(torch.matmul(g, w2.float()), pre)
            grad_w1.add_(torch.matmul(grad_pre.flatten(0, -2).t(), x_c.flatten(0, -2)))
            grad_b1.add_(grad_pre.sum(dim=tuple(range(grad_pre.dim() - 1))))
            grad_x[rows] = torch.matmul(grad_pre, w1.float()).to(x.dtype)
        if grad_bias is not None and not ctx.add_bias:
            grad_b2.add_(grad_bias.float())
        return (grad_x, grad_w1.to(w1.dtype), grad_b1.to(b1.dtype), grad_w2.to(w2.dtype), grad_b2.to(b2.dtype),
                None, None)


class FPDT_LogitsLoss(torch.autograd.Function):
    """Per-token cross entropy of ``lm_output [l, b, h] @ logit_weights.T`` against ``labels [b, l]``, computed
    ``num_chunk`` chunks at a time, gathered over the sequence group: returns fp32 ``[l * spg_size, b]`` in rank
    order (FPDT order, matching ``FPDT_InputConstruct``'s loss mask). ``rank`` is this rank in ``spg``. Labels
    equal to -100 (PyTorch's ignore index) give a zero loss and no gradient."""

    @staticmethod
    def forward(ctx: Any, lm_output: Tensor, labels: Tensor, logit_weights: Tensor, rank: int, spg_size: int,
                spg: Any, num_chunk: int) -> Tensor:
        length, batch = lm_output.shape[0], lm_output.shape[1]
        if isinstance(num_chunk, bool) or not isinstance(num_chunk, int) or num_chunk < 1 or length % num_chunk:
            raise ValueError(f"FPDT_LogitsLoss: the local sequence length ({length}) must be a multiple of a "
                             f"positive num_chunk, got {num_chunk!r}")
        if tuple(labels.shape) != (batch, length):
            raise ValueError(f"FPDT_LogitsLoss: labels must be [batch, local_seq] = {(batch, length)}, got "
                             f"{tuple(labels.shape)}")
        size = length // num_chunk
        labels_t = labels.t()
        loss = torch.empty(length, batch, dtype=torch.float32, device=lm_output.device)
        for i in range(num_chunk):
            rows = slice(i * size, (i + 1) * size)
            logits = torch.matmul(lm_output[rows], logit_weights.t()).float()
            loss[rows] = F.cross_entropy(logits.flatten(0, 1), labels_t[rows].reshape(-1),
                                         reduction="none").view(size, batch)
        # the input waits in host memory for the backward pass; the logits are recomputed there
        ctx.save_for_backward(lm_output.detach().to("cpu"), labels_t, logit_weights)
        ctx.meta = (lm_output.device, lm_output.dtype, rank, num_chunk, size)
        gathered = [torch.empty_like(loss) for _ in range(spg_size)]
        dist.all_gather(gathered, loss, group=spg)
        return torch.cat(gathered, dim=0)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Any, ...]:
        lm_host, labels_t, weight = ctx.saved_tensors
        device, dtype, rank, num_chunk, size = ctx.meta
        length = lm_host.shape[0]
        mine = grad_output[rank * length:(rank + 1) * length].float()
        grad_lm = torch.empty(lm_host.shape, dtype=dtype, device=device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for i in range(num_chunk):
            rows = slice(i * size, (i + 1) * size)
            lm = lm_host[rows].to(device)
            logits = torch.matmul(lm, weight.t()).float()
            grad_logits = torch.softmax(logits, dim=-1)
            target = labels_t[rows]
            kept = target != -100
            grad_logits.scatter_add_(-1, target.clamp(min=0).unsqueeze(-1), -kept.unsqueeze(-1).float())
            grad_logits.mul_((mine[rows] * kept).unsqueeze(-1))
            grad_lm[rows] = torch.matmul(grad_logits, weight.float()).to(dtype)
            grad_w.add_(torch.matmul(grad_logits.flatten(0, 1).t(), lm.float().flatten(0, 1)))
        return grad_lm, None, grad_w.to(weight.dtype), None, None, None, None
