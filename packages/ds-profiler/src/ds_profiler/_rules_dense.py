"""Cost rules for multiply-accumulate ops: matmul family, convolution, attention, fused recurrent layers.

Each rule takes the aten call ``(args, kwargs, out)`` and returns ``(macs, flops)``. For these ops one MAC is
one multiply plus one add, so FLOPs = 2 x MACs; bias additions fused into ``addmm``/``convolution`` are not
counted (DeepSpeed's convention for ``nn.Linear``, and ``torch.utils.flop_counter``'s for the matmul family).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

Cost = tuple[int, int]

# Elementwise FLOPs per (step, batch row, hidden unit) of one recurrent cell, as torch's decomposed cells
# run them: RNN: gate add + activation; LSTM: 4H gate add, 3 sigmoid, 2 tanh, c = f*c + i*g, h = o*tanh(c);
# GRU: 2 adds + 2 sigmoid for r and z, r*h_n, add, tanh, then h' = n + z*(h - n).
_CELL_POINTWISE = {"rnn": 2, "lstm": 13, "gru": 10}
# cuDNN / oneDNN / MIOpen mode ids (the same numbering in all three backends).
_MODE_NAMES = {0: "rnn", 1: "rnn", 2: "lstm", 3: "gru"}


def _mac_cost(macs: int) -> Cost:
    return macs, 2 * macs


def mm_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``mm(a[m,k], b[k,n])``: m*k*n MACs."""
    a, b = args[0], args[1]
    return _mac_cost(a.shape[0] * a.shape[1] * b.shape[1])


def addmm_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``addmm(bias, a[m,k], b[k,n])``: m*k*n MACs; the bias add is not counted."""
    return mm_rule(args[1:], kwargs, out)


def bmm_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``bmm(a[b,m,k], b[b,k,n])``: b*m*k*n MACs."""
    a, b = args[0], args[1]
    return _mac_cost(a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2])


def baddbmm_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``baddbmm/addbmm(input, a, b)``: the bmm's MACs."""
    return bmm_rule(args[1:], kwargs, out)


def mv_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``mv(a[m,n], v[n])`` and ``dot/vdot``: one MAC per element of the matrix (or vector)."""
    return _mac_cost(args[0].numel())


def addmv_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``addmv(input, a, v)`` / ``addr(input, u, v)``: one MAC per element of the product."""
    return _mac_cost(args[1].numel() if args[1].dim() == 2 else args[1].numel() * args[2].numel())


def _conv_macs(x: Any, weight: Any, out: Any, transposed: bool) -> int:
    # Each output (or, transposed, each input) position costs Cin/groups * prod(kernel) MACs per channel.
    per_position = math.prod(weight.shape[1:])
    return (x.numel() if transposed else out.numel()) * per_position


def convolution_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``convolution(x, w, bias, stride, padding, dilation, transposed, ...)``, 1-3d, plain or transposed."""
    transposed = bool(args[6]) if len(args) > 6 else False
    return _mac_cost(_conv_macs(args[0], args[1], out, transposed))


def convolution_backward_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``convolution_backward``: one forward's MACs per requested grad (input, weight), bias grad a reduction."""
    grad_out, x, weight, transposed, mask = args[0], args[1], args[2], bool(args[7]), args[10]
    fwd = _conv_macs(x, weight, grad_out, transposed)
    macs = fwd * (int(bool(mask[0])) + int(bool(mask[1])))
    bias_flops = grad_out.numel() if mask[2] else 0
    return macs, 2 * macs + bias_flops


def _attention_dims(q: Any, k: Any, v: Any, seq_dim: int) -> tuple[int, int, int, int]:
    """(rows, keys, head_dim, value_dim): rows = batch * heads * queries."""
    return q.numel() // q.shape[-1], k.shape[seq_dim], q.shape[-1], v.shape[-1]


def attention_cost(q: Any, k: Any, v: Any, seq_dim: int = -2, backward: bool = False, masked: bool = False) -> Cost:
    """Scaled dot-product attention: QK^T and PV MACs; FLOPs add one per score for the softmax, one per score
    for an explicit mask, and the scaling of q and k (one per element) - the same count as torch's math path.

    The score matrix is counted dense, with or without a causal mask (what the math kernel computes and what
    ``torch.utils.flop_counter`` counts). Backward runs four such matmuls (dQ, dK, dV, dP): 2x the MACs.
    """
    rows, keys, head_dim, value_dim = _attention_dims(q, k, v, seq_dim)
    macs = rows * keys * (head_dim + value_dim)
    scores = rows * keys
    if backward:
        return 2 * macs, 4 * macs + 2 * scores
    return macs, 2 * macs + scores * (2 if masked else 1) + q.numel() + k.numel()


def _flag(args: Sequence[Any], kwargs: dict, index: int, name: str) -> Any:
    return kwargs.get(name, args[index] if len(args) > index else None)


def sdpa_rule(causal_index: int) -> Callable[[Sequence[Any], dict, Any], Cost]:
    """Fused SDPA kernels taking (query, key, value) as [batch, heads, seq, dim]; ``is_causal`` is their
    positional argument ``causal_index``. A causal or explicit mask costs one FLOP per score either way."""

    def rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
        # The mask is keyword-only on the CPU flash kernel, the 4th positional (attn_bias) on the others.
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        masked = hasattr(mask, "shape") or bool(_flag(args, kwargs, causal_index, "is_causal"))
        return attention_cost(args[0], args[1], args[2], masked=masked)

    rule.__doc__ = sdpa_rule.__doc__
    return rule


def _bshd_cost(q: Any, k: Any, v: Any, cum_q: Any, cum_k: Any, masked: bool) -> Cost:
    if cum_q is None or cum_k is None:
        return attention_cost(q, k, v, seq_dim=1, masked=masked)
    # Variable-length batch packed as [tokens, heads, dim]: sequence i has cum[i+1] - cum[i] tokens.
    pairs = int(((cum_q[1:] - cum_q[:-1]) * (cum_k[1:] - cum_k[:-1])).sum())
    heads = q.shape[-2]
    macs = pairs * heads * (q.shape[-1] + v.shape[-1])
    scores = pairs * heads
    return macs, 2 * macs + scores * (2 if masked else 1) + q.numel() + k.numel()


def flash_bshd_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``_flash_attention_forward(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, p, is_causal, ...)``."""
    return _bshd_cost(args[0], args[1], args[2], args[3], args[4], bool(_flag(args, kwargs, 8, "is_causal")))


def efficient_bshd_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``_efficient_attention_forward(q, k, v, bias, cu_seqlens_q, cu_seqlens_k, ..., custom_mask_type)``."""
    masked = hasattr(args[3], "shape") or bool(_flag(args, kwargs, 9, "custom_mask_type"))
    return _bshd_cost(args[0], args[1], args[2], args[4], args[5], masked)


def sdpa_backward_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """SDPA backward kernels: ``(grad_out, query, key, value, ...)`` in [batch, heads, seq, dim]."""
    return attention_cost(args[1], args[2], args[3], backward=True)


def sdpa_bshd_backward_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``_flash_attention_backward`` / ``_efficient_attention_backward``: [batch, seq, heads, dim]."""
    return attention_cost(args[1], args[2], args[3], seq_dim=1, backward=True)


def recurrent_cost(x: Any, matrices: Sequence[Any], mode: int, hidden: int, cells: int) -> Cost:
    """A fused recurrent op: every (step, batch row) multiplies each weight matrix once.

    ``matrices`` are the 2-D weights (w_ih, w_hh, w_hr per layer and direction), ``cells`` the number of
    layer x direction cells, ``hidden`` the hidden size. Elementwise gate FLOPs follow ``_CELL_POINTWISE``.
    """
    rows = x.numel() // x.shape[-1]
    name = _MODE_NAMES.get(int(mode))
    if name is None:
        raise ValueError(f"recurrent op with mode={mode!r}: expected one of {sorted(_MODE_NAMES)}")
    macs = rows * sum(w.numel() for w in matrices if w is not None and w.dim() == 2)
    return macs, 2 * macs + rows * cells * hidden * _CELL_POINTWISE[name]


def mkldnn_rnn_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``mkldnn_rnn_layer``: one layer, one direction (torch's CPU LSTM)."""
    return recurrent_cost(args[0], [args[1], args[2]], args[9], args[10], 1)


def mkldnn_rnn_backward_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``mkldnn_rnn_layer_backward``: grads of input/hidden and of weights, 2x the forward."""
    macs, flops = recurrent_cost(args[0], [args[1], args[2]], args[14], args[15], 1)
    return 2 * macs, 2 * flops


def _stack_cells(num_layers: int, bidirectional: bool) -> int:
    return int(num_layers) * (2 if bidirectional else 1)


def cudnn_rnn_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``_cudnn_rnn``: the whole stack of layers and directions in one call."""
    cells = _stack_cells(args[9], args[13])
    return recurrent_cost(args[0], args[1], args[6], args[7], cells)


def cudnn_rnn_backward_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``_cudnn_rnn_backward``: 2x the forward."""
    macs, flops = recurrent_cost(args[0], args[1], args[10], args[11], _stack_cells(args[13], args[17]))
    return 2 * macs, 2 * flops


def miopen_rnn_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``miopen_rnn`` (ROCm): the whole stack in one call."""
    return recurrent_cost(args[0], args[1], args[5], args[6], _stack_cells(args[7], args[11]))


def native_mha_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``_native_multi_head_attention`` (nn.MultiheadAttention's inference fast path): in-projections of
    query/key/value, the attention itself and the output projection, as the unfused module would count."""
    query, key, embed_dim, num_heads = args[0], args[1], int(args[3]), int(args[4])
    rows_q, rows_k = query.numel() // query.shape[-1], key.numel() // key.shape[-1]
    proj_macs = embed_dim * embed_dim * (2 * rows_q + 2 * rows_k)
    batch = rows_q // query.shape[-2]
    scores = batch * num_heads * query.shape[-2] * key.shape[-2]
    attn_macs = scores * 2 * (embed_dim // num_heads)
    return proj_macs + attn_macs, 2 * (proj_macs + attn_macs) + scores


def native_encoder_layer_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``_transformer_encoder_layer_fwd`` (nn.TransformerEncoderLayer's fast path): self-attention, two layer
    norms (5 FLOPs/element), the feed-forward matmuls and its activation (1 FLOP/element)."""
    src, embed_dim, num_heads = args[0], int(args[1]), int(args[2])
    macs, flops = native_mha_rule((src, src, src, embed_dim, num_heads), kwargs, out)
    ffn_dim = args[14].shape[0]
    tokens = src.numel() // src.shape[-1]
    ffn_macs = 2 * tokens * embed_dim * ffn_dim
    return macs + ffn_macs, flops + 2 * ffn_macs + 2 * 5 * tokens * embed_dim + tokens * ffn_dim
