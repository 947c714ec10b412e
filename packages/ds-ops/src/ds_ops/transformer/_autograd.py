"""Autograd functions behind the transformer layer's memory options.

Each one computes what the plain torch ops compute but keeps fewer activations for backward, recomputing the rest
(the trade DeepSpeed's CUDA kernels make under the same options):

- ``dropout_attention``: attention with an explicit dropout mask; optionally does not keep the dropped-out
  probabilities (``attn_dropout_checkpoint``), rebuilding them from the probabilities and the mask.
- ``gelu_linear``: ``linear(gelu(x))`` keeping only ``x`` (``gelu_checkpoint``), not the GeLU output.
- ``invertible_layer_norm``: LayerNorm whose backward works from its output (``normalize_invertible``), so its
  input need not be kept; the output is kept anyway by the next matmul. Requires non-zero LayerNorm weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def _sum_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Reduce a broadcast gradient back to ``shape``."""
    while grad.dim() > len(shape):
        grad = grad.sum(0)
    for dim, size in enumerate(shape):
        if size == 1 and grad.shape[dim] != 1:
            grad = grad.sum(dim, keepdim=True)
    return grad


class _DropoutAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, keep, p, keep_dropped):  # noqa: ANN001, ANN205 (autograd signature)
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if bias is not None:
            scores = scores + bias
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # fp32 softmax for half inputs
        dropped = probs * keep * (1.0 / (1.0 - p))
        out = torch.matmul(dropped, v)
        ctx.scale, ctx.p, ctx.keep_dropped = scale, p, keep_dropped
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.save_for_backward(q, k, v, probs, keep, dropped if keep_dropped else None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        q, k, v, probs, keep, dropped = ctx.saved_tensors
        if dropped is None:  # attn_dropout_checkpoint: rebuild instead of having kept it
            dropped = probs * keep * (1.0 / (1.0 - ctx.p))
        grad_v = torch.matmul(dropped.transpose(-1, -2), grad_out)
        del dropped
        grad_probs = torch.matmul(grad_out, v.transpose(-1, -2)) * keep * (1.0 / (1.0 - ctx.p))
        grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))
        grad_q = torch.matmul(grad_scores, k) * ctx.scale
        grad_k = torch.matmul(grad_scores.transpose(-1, -2), q) * ctx.scale
        grad_bias = None
        if ctx.bias_shape is not None and ctx.needs_input_grad[3]:
            grad_bias = _sum_to(grad_scores, ctx.bias_shape)
        return grad_q, grad_k, grad_v, grad_bias, None, None, None


def dropout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                      keep: torch.Tensor, p: float, keep_dropped: bool = True) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + bias)`` dropped out with the boolean ``keep`` mask (scaled by ``1/(1-p)``), times
    ``v``. ``q, k, v``: ``[batch, heads, seq, head_dim]``; ``bias``: additive, broadcastable to the scores.
    ``keep_dropped=False`` rebuilds the dropped-out probabilities in backward instead of keeping them."""
    return _DropoutAttention.apply(q, k, v, bias, keep, p, keep_dropped)


class _GeluLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(F.gelu(x), weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            activated = F.gelu(leaf)  # the recomputation gelu_checkpoint trades for memory
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = flat_grad.t() @ activated.detach().reshape(-1, activated.shape[-1])
        grad_bias = flat_grad.sum(0) if ctx.has_bias else None
        (grad_x,) = torch.autograd.grad(activated, leaf, grad_out @ weight)
        return grad_x, grad_weight, grad_bias


def gelu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(F.gelu(x), weight, bias)`` that keeps ``x`` for backward but not ``gelu(x)``."""
    return _GeluLinear.apply(x, weight, bias)


class _InvertibleLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):  # noqa: ANN001, ANN205
        wide = torch.promote_types(x.dtype, torch.float32)  # half inputs normalise in fp32
        xw = x.to(wide)
        var, mean = torch.var_mean(xw, dim=-1, keepdim=True, correction=0)
        rstd = torch.rsqrt(var + eps)
        out = ((xw - mean) * rstd * weight.to(wide) + bias.to(wide)).to(x.dtype)
        ctx.save_for_backward(out, weight, bias, rstd)  # the output, not the input
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        out, weight, bias, rstd = ctx.saved_tensors
        wide = rstd.dtype
        normalized = (out.to(wide) - bias.to(wide)) / weight.to(wide)  # invert the affine step
        grad32 = grad_out.to(wide)
        scaled = grad32 * weight.to(wide)
        grad_x = rstd * (scaled - scaled.mean(-1, keepdim=True)
                         - normalized * (scaled * normalized).mean(-1, keepdim=True))
        flat = grad32.reshape(-1, grad32.shape[-1])
        grad_weight = (flat * normalized.reshape(flat.shape)).sum(0).to(weight.dtype)
        grad_bias = flat.sum(0).to(bias.dtype)
        return grad_x.to(out.dtype), grad_weight, grad_bias, None


def invertible_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension whose backward needs its output, not its input (``weight`` must have no
    zero entry: the input is recovered by dividing by it)."""
    return _InvertibleLayerNorm.apply(x, weight, bias, eps)
