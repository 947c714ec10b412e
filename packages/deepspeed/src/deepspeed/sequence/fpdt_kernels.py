"""Attention of one query chunk against one key/value chunk, and the online-softmax merge FPDT builds on.

Every block returns its output and the log-sum-exp (LSE) of its scores per query row, ``out [b, s, h, d]`` and
``lse [b, h, s]`` (flash-attn's layout). Merging blocks by their LSEs (``update_out_and_lse``) gives exactly the
softmax over the union of their keys, so attention over chunks equals attention over the whole sequence. The
backward of a block takes the merged output and LSE of its query rows, so each block's gradient is its share of
the full attention's gradient and the shares simply add up.

Backends: flash-attn's ``_flash_attn_forward``/``_flash_attn_backward`` (DeepSpeed's kernels) when flash-attn
imports, the tensors are fp16/bf16 on CUDA and there is no dropout; otherwise explicit attention in fp32 in torch
(any device and dtype). The torch path applies dropout with a mask regenerated from a per-block seed in the
backward pass, so forward and backward drop the same entries.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import torch
from torch import Tensor


def _version_tuple(text: str) -> tuple[int, ...]:
    """``"2.7.4.post1"`` -> ``(2, 7, 4)``: enough to pick flash-attn's call signature."""
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


# flash-attn is optional and undeclared: looked up at the first block that could use it, not at import
_FLASH: Any = False  # False: not looked up yet; None: unavailable; else (forward, backward, version)


def _flash_kernels() -> Any:
    global _FLASH
    if _FLASH is False:
        _FLASH = None
        if importlib.util.find_spec("flash_attn") is not None:
            try:
                import flash_attn
                from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
            except ImportError:
                pass
            else:
                _FLASH = (_flash_attn_forward, _flash_attn_backward, _version_tuple(flash_attn.__version__))
    return _FLASH


def flash_attn_available() -> bool:
    """Whether flash-attn's kernels import (FPDT then uses them for fp16/bf16 CUDA tensors without dropout)."""
    return _flash_kernels() is not None


def acc(t: Tensor) -> Tensor:
    """``t`` in the accumulation precision: fp32, or fp64 for fp64 tensors."""
    return t if t.dtype == torch.float64 else t.float()


def _use_flash(q: Tensor, dropout_p: float) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0 and flash_attn_available()


def _expand_kv(t: Tensor, heads: int) -> Tensor:
    """Key/value heads repeated for grouped-query attention: query head j reads key/value head j // group."""
    kv_heads = t.shape[2]
    if heads % kv_heads:
        raise ValueError(f"FPDT attention: the query head count ({heads}) must be a multiple of the key/value head "
                         f"count ({kv_heads})")
    return t if kv_heads == heads else t.repeat_interleave(heads // kv_heads, dim=2)


def _fold_kv(t: Tensor, kv_heads: int) -> Tensor:
    """Sum the gradients of repeated key/value heads back onto their source heads."""
    heads = t.shape[2]
    return t if kv_heads == heads else t.unflatten(2, (kv_heads, heads // kv_heads)).sum(dim=3)


def _keep_mask(shape: tuple[int, ...], dropout_p: float, seed: int, device: torch.device) -> Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(shape, generator=gen, device=device) >= dropout_p


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
    """Scores ``[b, h, s, t]`` (fp32, fp64 for fp64 inputs); with ``causal`` key t is hidden from query s when
    t > s (equal-length chunks)."""
    scores = torch.einsum("bshd,bthd->bhst", acc(q), acc(_expand_kv(k, q.shape[2]))) * scale
    if causal:
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"FPDT attention: a causal block needs equal query and key chunk lengths, got "
                             f"{q.shape[1]} and {k.shape[1]}")
        hidden = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def block_attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, dropout_p: float = 0.0,
                            seed: int = 0) -> tuple[Tensor, Tensor]:
    """One block: ``q [b, s, h, d]`` against ``k, v [b, t, h_kv, d]``; returns fp32 ``out [b, s, h, d]`` and
    ``lse [b, h, s]``. ``seed`` picks the dropout mask (the backward pass must get the same one)."""
    if _use_flash(q, dropout_p):
        return _flash_forward(q, k, v, causal, scale)
    scores = _scores(q, k, scale, causal)
    lse = scores.logsumexp(dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if dropout_p > 0:
        probs = probs * _keep_mask(tuple(probs.shape), dropout_p, seed, q.device) / (1 - dropout_p)
    out = torch.einsum("bhst,bthd->bshd", probs, acc(_expand_kv(v, q.shape[2])))
    return out, lse


def block_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                             scale: float, dropout_p: float = 0.0, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (fp32) of one block given the merged ``out [b, s, h, d]`` and ``lse [b, h, s]`` of its query
    rows and their gradient ``dout``; returns ``dq`` like ``q`` and ``dk``, ``dv`` like ``k``, ``v``."""
    if _use_flash(q, dropout_p):
        return _flash_backward(dout, q, k, v, out, lse, causal, scale)
    heads, kv_heads = q.shape[2], k.shape[2]
    k_full, v_full = acc(_expand_kv(k, heads)), acc(_expand_kv(v, heads))
    probs = torch.exp(_scores(q, k, scale, causal) - acc(lse).unsqueeze(-1))
    dout32 = acc(dout)
    dprobs = torch.einsum("bshd,bthd->bhst", dout32, v_full)
    if dropout_p > 0:
        keep = _keep_mask(tuple(probs.shape), dropout_p, seed, q.device) / (1 - dropout_p)
        dv = torch.einsum("bhst,bshd->bthd", probs * keep, dout32)
        dprobs = dprobs * keep
    else:
        dv = torch.einsum("bhst,bshd->bthd", probs, dout32)
    # softmax backward: the row term sum_t P*dP equals dout . out for the merged rows (also under dropout)
    row = (dout32 * acc(out)).sum(dim=-1).transpose(1, 2).unsqueeze(-1)  # [b, h, s, 1]
    dscores = probs * (dprobs - row) * scale
    dq = torch.einsum("bhst,bthd->bshd", dscores, k_full)
    dk = torch.einsum("bhst,bshd->bthd", dscores, acc(q))
    return dq, _fold_kv(dk, kv_heads), _fold_kv(dv, kv_heads)


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # the kernels need unit stride on the head dim
    _flash_attn_forward, _, version = _flash_kernels()
    common = dict(causal=causal, alibi_slopes=None, return_softmax=False)
    if version >= (2, 7):  # window split into two ints; 4 return values
        out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, scale, window_size_left=-1, window_size_right=-1,
                                             softcap=0.0, **common)
    elif version >= (2, 6):
        out, _, _, _, _, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, scale, window_size=(-1, -1), softcap=0.0,
                                                         **common)
    else:
        out, _, _, _, _, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, scale, window_size=(-1, -1), **common)
    return out.float(), lse


def _flash_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                    scale: float) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    _, _flash_attn_backward, version = _flash_kernels()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = (dout.contiguous(), q, k, v, out.to(q.dtype).contiguous(), lse.contiguous(), dq, dk, dv, 0.0, scale, causal)
    if version >= (2, 7):
        _flash_attn_backward(*args, -1, -1, 0.0, None, False, rng_state=None)
    elif version >= (2, 6):
        _flash_attn_backward(*args, (-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None)
    else:
        _flash_attn_backward(*args, (-1, -1), alibi_slopes=None, deterministic=False, rng_state=None)
    return dq.float(), dk.float(), dv.float()


def update_out_and_lse(out: Tensor | None, lse: Tensor | None, block_out: Tensor, block_lse: Tensor,
                       slice_: object = None) -> tuple[Tensor, Tensor]:
    """Merge a block (``block_out [b, s, h, d]``, ``block_lse [b, h, s]``) into the running fp32 ``out`` and
    ``lse [b, s, h, 1]`` (None on the first block): the softmax over the union of both key sets.
    ``slice_`` indexes the rows of ``out``/``lse`` the block covers (not on the first block)."""
    block_out = acc(block_out)
    block_lse = acc(block_lse).transpose(1, 2).unsqueeze(-1)
    if out is None:
        if slice_ is not None:
            raise ValueError("update_out_and_lse: slice_ needs a running out/lse; the first block covers all rows")
        return block_out.clone(), block_lse.contiguous()
    if slice_ is None:
        return _merge(out, lse, block_out, block_lse)
    out[slice_], lse[slice_] = _merge(out[slice_], lse[slice_], block_out, block_lse)
    return out, lse


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    merged = torch.logaddexp(lse, block_lse)
    return torch.exp(lse - merged) * out + torch.exp(block_lse - merged) * block_out, merged


def apply_rotary_pos_emb_backward(grad_output: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Gradient through ``apply_rotary_pos_emb(t, cos, sin) = t*cos + rotate_half(t)*sin`` with respect to ``t``
    (features past ``cos.shape[-1]`` pass through)."""
    rot_dim = freqs_cos.shape[-1]
    grad, grad_pass = grad_output[..., :rot_dim], grad_output[..., rot_dim:]
    scaled = grad * freqs_sin
    first, second = scaled.unflatten(-1, (2, rot_dim // 2)).unbind(dim=-2)
    # rotate_half's transpose: (u1, u2) -> (u2, -u1)
    grad = grad * freqs_cos + torch.cat((second, -first), dim=-1)
    return grad if grad_pass.shape[-1] == 0 else torch.cat((grad, grad_pass), dim=-1)
