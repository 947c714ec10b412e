"""FPDT's block kernels: the flash-attn adapter against fakes with flash-attn's call signatures (2.5, 2.6, 2.7+).

No flash-attn is installed here, so fakes with exactly flash-attn's argument lists stand in for
``_flash_attn_forward``/``_flash_attn_backward``; a wrong argument order or count fails as a TypeError or a wrong
number. The fakes compute attention explicitly (the backward from the merged output and log-sum-exp it is given,
as flash-attn does), and FPDT through them must equal full causal attention.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import run_distributed

from deepspeed.sequence import fpdt_kernels
from deepspeed.sequence.fpdt_layer import _FPDTGPUAttentionImpl_


def _probs(q, k, scale, causal, lse=None):
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bshd,bthd->bhst", q, k) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = s.logsumexp(-1) if lse is None else lse
    return torch.exp(s - lse.unsqueeze(-1)), lse


def _fake_forward(q, k, v, scale, causal):
    probs, lse = _probs(q, k, scale, causal)
    return torch.einsum("bhst,bthd->bshd", probs, v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)), lse


def _fake_backward(dout, q, k, v, out, lse, dq, dk, dv, scale, causal):
    group = q.shape[2] // k.shape[2]
    kf, vf = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    probs, _ = _probs(q, k, scale, causal, lse)
    dprobs = torch.einsum("bshd,bthd->bhst", dout, vf)
    ds = probs * (dprobs - (dout * out).sum(-1).transpose(1, 2).unsqueeze(-1)) * scale
    dq.copy_(torch.einsum("bhst,bthd->bshd", ds, kf))
    dk.copy_(torch.einsum("bhst,bshd->bthd", ds, q).unflatten(2, (k.shape[2], group)).sum(3))
    dv.copy_(torch.einsum("bhst,bshd->bthd", probs, dout).unflatten(2, (v.shape[2], group)).sum(3))


def fwd_27(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
           return_softmax):
    assert (window_size_left, window_size_right, softcap, dropout_p) == (-1, -1, 0.0, 0.0)
    out, lse = _fake_forward(q, k, v, softmax_scale, causal)
    return out, lse, None, None


def bwd_27(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
           window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    assert (window_size_left, window_size_right, softcap) == (-1, -1, 0.0)
    _fake_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)


def fwd_26(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    assert tuple(window_size) == (-1, -1) and softcap == 0.0
    out, lse = _fake_forward(q, k, v, softmax_scale, causal)
    return out, q, k, v, out, lse, None, None


def bwd_26(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size, softcap,
           alibi_slopes, deterministic, rng_state=None):
    _fake_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)


def fwd_25(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    out, lse = _fake_forward(q, k, v, softmax_scale, causal)
    return out, q, k, v, out, lse, None, None


def bwd_25(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
           deterministic, rng_state=None):
    _fake_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)


FAKES = {(2, 7, 4): (fwd_27, bwd_27), (2, 6, 3): (fwd_26, bwd_26), (2, 5, 9): (fwd_25, bwd_25)}


def _through_fake_flash(version):
    seq, batch, heads, kv_heads, d = 16, 2, 4, 2, 8
    hidden = heads * d
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(seq, batch, hidden, generator=gen, requires_grad=True)
    rows = (heads + 2 * kv_heads) * d
    w = (torch.randn(rows, hidden, generator=gen) * hidden ** -0.5).requires_grad_()
    b = torch.zeros(rows, requires_grad=True)
    upstream = torch.randn(batch, seq, heads, d, generator=gen)

    saved = (fpdt_kernels._FLASH, fpdt_kernels._use_flash)
    calls = []
    fwd, bwd = FAKES[version]

    def counted(fn):
        def call(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)
        return call

    fpdt_kernels._FLASH = (counted(fwd), counted(bwd), version)
    fpdt_kernels._use_flash = lambda q, p: p == 0  # the fakes run on CPU in fp32
    try:
        out = _FPDTGPUAttentionImpl_.apply(x, None, None, None, dist.group.WORLD, 2, 0, hidden, heads * d, d,
                                           kv_heads * d, w, b, 0.0, 4, False)
        out.backward(upstream)
    finally:  # the worker process runs other tests next
        fpdt_kernels._FLASH, fpdt_kernels._use_flash = saved
    assert calls.count(fwd.__name__) == 10 and calls.count(bwd.__name__) == 10  # 4 chunks: 4+3+2+1 blocks

    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    q, k, v = (xr @ wr.t()).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, d)).permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    expected.backward(upstream)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, expected, **tol)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    torch.testing.assert_close(w.grad, wr.grad, **tol)


@pytest.mark.parametrize("version", list(FAKES), ids=lambda v: "flash" + ".".join(map(str, v)))
def test_flash_attn_adapter_signatures(version):
    run_distributed(_through_fake_flash, world_size=1, args=(version,), timeout=60)


def test_version_parsing_and_dispatch_rules():
    assert fpdt_kernels._version_tuple("2.7.4.post1") == (2, 7, 4)
    assert fpdt_kernels._version_tuple("2.6.3") >= (2, 6) > fpdt_kernels._version_tuple("2.5.9")
    q = torch.zeros(1, 2, 1, 4)
    assert not fpdt_kernels._use_flash(q, 0.0)  # CPU tensors always take the torch path
    assert not fpdt_kernels._use_flash(q.half(), 0.0)
    # without flash-attn installed the lookup says so (and is cached), rather than failing
    assert fpdt_kernels.flash_attn_available() == (importlib.util.find_spec("flash_attn") is not None)
