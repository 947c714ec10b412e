"""FPDT (``deepspeed.sequence.fpdt_layer``) against the unchunked computation on one rank.

Two gloo ranks run the chunked, offloaded Ulysses attention over their FPDT-ordered tokens; outputs, input
gradients and the (summed) weight gradients must equal full causal attention over the whole sequence, for several
chunk sizes, with and without host offloading, with grouped-query heads and rotary embeddings. The chunked
feed-forward block and vocabulary loss are checked the same way, and the token order against a hand-built one.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import run_distributed

from deepspeed.sequence.fpdt_layer import (
    FPDT_FFN,
    FPDT_Attention,
    FPDT_InputConstruct,
    FPDT_LogitsLoss,
    SequenceChunk,
    _FPDTGPUAttentionImpl_,
    _FPDTGPUOffloadingAttentionImpl_,
    fpdt_token_order,
)

TOL = dict(rtol=1e-4, atol=1e-5)
SEQ, BATCH, HEADS, HEAD_DIM = 16, 2, 4, 8
HIDDEN = HEADS * HEAD_DIM


def _args(chunk):
    return types.SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=chunk)


def _mine(t, chunk, rank, world):
    """This rank's FPDT slice of a ``[b, L, ...]`` tensor."""
    return FPDT_InputConstruct(t, None, None, None, None, _args(chunk), world, rank).generate()[0]


# ---------------------------------------------------------------- token order


def test_token_order_matches_a_hand_built_layout():
    # 8 tokens, chunks of 4, 2 ranks: each rank holds its half of each chunk
    tokens = torch.arange(8).unsqueeze(0)
    got = [FPDT_InputConstruct(tokens, None, None, None, None, _args(4), 2, r).generate()[0] for r in range(2)]
    assert got[0].tolist() == [[0, 1, 4, 5]]
    assert got[1].tolist() == [[2, 3, 6, 7]]


@pytest.mark.parametrize("world,chunk", [(1, 4), (2, 4), (2, 16), (4, 8), (4, 32)])
def test_input_construct_round_trips(world, chunk):
    seq = 32
    tokens = torch.arange(2 * seq).view(2, seq)
    labels, positions = tokens + 1000, torch.arange(seq).expand(2, seq)
    loss_mask, attn = torch.rand(2, seq), torch.ones(1, 1, seq, seq)
    parts = [FPDT_InputConstruct(tokens, labels, loss_mask, attn, positions, _args(chunk), world, r).generate()
             for r in range(world)]
    order = fpdt_token_order(seq, chunk, world)
    assert sorted(order.tolist()) == list(range(seq))
    gathered = torch.cat([p[0] for p in parts], dim=1)
    restored = torch.empty_like(gathered)
    restored[:, order] = gathered
    assert torch.equal(restored, tokens)
    for rank, (tok, lab, mask, att, pos) in enumerate(parts):
        assert torch.equal(lab, tok + 1000) and torch.equal(pos, positions[:, tok[0]])
        assert torch.equal(mask, loss_mask[:, order]) and att is attn
        piece = chunk // world  # rank r: tokens [j*chunk + r*piece, j*chunk + (r+1)*piece) of each chunk j
        expected = [j * chunk + rank * piece + t for j in range(seq // chunk) for t in range(piece)]
        assert tok[0].tolist() == expected


@pytest.mark.parametrize("seq,chunk,world", [(30, 8, 2), (32, 6, 2), (32, 0, 2)])
def test_input_construct_rejects_uneven_splits(seq, chunk, world):
    with pytest.raises(ValueError, match="FPDT"):
        FPDT_InputConstruct(torch.zeros(1, seq), None, None, None, None, _args(chunk), world, 0)


# ---------------------------------------------------------------- host copies


def test_sequence_chunk_keeps_a_host_copy_and_loads_fresh_working_copies():
    data = torch.arange(6.0).view(2, 3)
    chunk = SequenceChunk(data, is_in_use=True)
    assert chunk.is_resident and chunk.get_gpu_chunk() is data
    chunk.offload()
    assert not chunk.is_resident
    with pytest.raises(RuntimeError, match="offloaded"):
        chunk.get_gpu_chunk()
    working = chunk.load_to_gpu()
    assert working is not data and torch.equal(working, data)
    working.add_(1)
    assert torch.equal(chunk.cpu_chunk, data)  # not written back until asked
    with pytest.raises(RuntimeError, match="already loaded"):
        chunk.load_to_gpu()
    chunk.overwrite_to_cpu()
    chunk.offload()
    assert torch.equal(chunk.load_to_gpu(), torch.arange(6.0).view(2, 3) + 1)


# ---------------------------------------------------------------- attention


def _reference_attention(x, weight, bias, heads, kv_heads, rope):
    """Full causal attention over ``x [L, b, hidden]``; returns ``[b, L, heads, head_dim]``."""
    d = HEAD_DIM
    qkv = x @ weight.t() + bias
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, d)).permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, L, d]
    if rope is not None:
        cos, sin = (t.permute(1, 2, 0, 3) for t in rope)  # [L, b, 1, d] -> [b, 1, L, d]
        rot = lambda t: t * cos + torch.cat((-t[..., d // 2:], t[..., :d // 2]), dim=-1) * sin  # noqa: E731
        q, k = rot(q), rot(k)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def _inputs(kv_heads, rotary, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    rows = (HEADS + 2 * kv_heads) * HEAD_DIM
    weight = torch.randn(rows, HIDDEN, generator=gen) * HIDDEN ** -0.5
    bias = torch.randn(rows, generator=gen) * 0.1
    upstream = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=gen)
    rope = None
    if rotary:
        angles = torch.randn(SEQ, 1, 1, HEAD_DIM // 2, generator=gen).repeat(1, 1, 1, 2)
        rope = (angles.cos(), angles.sin())
    return x, weight, bias, upstream, rope


def _attention_matches(chunk, offload, kv_heads, rotary):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, weight, bias, upstream, rope = _inputs(kv_heads, rotary)
    full = [t.clone().requires_grad_() for t in (x, weight, bias)]
    expected = _reference_attention(*full, HEADS, kv_heads, rope)
    expected.backward(upstream)

    local_x = _mine(x.transpose(0, 1), chunk, rank, world).transpose(0, 1).clone().requires_grad_()
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    impl = _FPDTGPUOffloadingAttentionImpl_ if offload else _FPDTGPUAttentionImpl_
    num_chunks = SEQ // chunk
    out = impl.apply(local_x, None, None, rope, dist.group.WORLD, 2, 0, HIDDEN, HEADS * HEAD_DIM, HEAD_DIM,
                     kv_heads * HEAD_DIM, w, b, 0.0, num_chunks, offload)
    saved = out.grad_fn.chunks  # q, k, v, outputs, lses, inputs
    resident = [c.is_resident for group in saved for c in group]
    assert len(saved[0]) == num_chunks
    assert not any(resident) if offload else any(resident)
    out.backward(_mine(upstream, chunk, rank, world))

    torch.testing.assert_close(out, _mine(expected.detach(), chunk, rank, world), **TOL)
    torch.testing.assert_close(local_x.grad, _mine(full[0].grad.transpose(0, 1), chunk, rank, world).transpose(0, 1),
                               **TOL)
    for name, mine, ref in (("weight", w, full[1]), ("bias", b, full[2])):
        grad = mine.grad.clone()
        dist.all_reduce(grad)  # each rank holds its tokens' share
        torch.testing.assert_close(grad, ref.grad, **TOL, msg=f"qkv {name} gradient")


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload"])
@pytest.mark.parametrize("chunk", [4, 8, 16], ids=lambda c: f"chunk{c}")
def test_two_ranks_equal_full_causal_attention(chunk, offload):
    run_distributed(_attention_matches, world_size=2, args=(chunk, offload, HEADS, False), timeout=60)


@pytest.mark.parametrize("kv_heads,rotary", [(2, False), (HEADS, True), (2, True)], ids=["gqa", "rope", "gqa_rope"])
def test_two_ranks_grouped_query_heads_and_rotary(kv_heads, rotary):
    run_distributed(_attention_matches, world_size=2, args=(4, True, kv_heads, rotary), timeout=60)


def _dropout_gradcheck():
    gen = torch.Generator().manual_seed(1)
    seq, hidden, heads = 8, 8, 2
    x = torch.randn(seq, 1, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(3 * hidden, hidden, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
    b = torch.randn(3 * hidden, generator=gen, dtype=torch.float64, requires_grad=True)

    def attend(x, w, b, p=0.3):
        torch.manual_seed(123)  # the same dropout masks on every call gradcheck makes
        return _FPDTGPUOffloadingAttentionImpl_.apply(x, None, None, None, dist.group.WORLD, 2, 0, hidden, hidden,
                                                      hidden // heads, hidden, w, b, p, 4, True)

    dropped, kept = attend(x, w, b), attend(x, w, b, 0.0)
    assert not torch.allclose(dropped, kept)
    assert torch.autograd.gradcheck(attend, (x, w, b), fast_mode=True)


def test_dropout_backward_matches_finite_differences():
    run_distributed(_dropout_gradcheck, world_size=1, timeout=120)


def _layer_matches(return_bias):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, weight, bias, _, _ = _inputs(HEADS, False, seed=3)
    gen = torch.Generator().manual_seed(4)
    dense_w, dense_b = torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.2, torch.randn(HIDDEN, generator=gen)
    config = types.SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                   kv_channels=HEAD_DIM, attention_dropout=0.5)
    layer = FPDT_Attention(config, torch.nn.Parameter(weight), torch.nn.Parameter(bias), torch.nn.Parameter(dense_w),
                           torch.nn.Parameter(dense_b), dist.group.WORLD, return_bias=return_bias, chunk_size=8)
    layer.eval()  # no dropout at evaluation
    local_x = _mine(x.transpose(0, 1), 8, rank, world).transpose(0, 1)
    out, out_bias = layer(local_x, None, None, None)
    expected = _reference_attention(x, weight, bias, HEADS, HEADS, None).flatten(2) @ dense_w.t()
    if return_bias:
        assert out_bias is layer.qkv_dense_bias
    else:
        assert out_bias is None
        expected = expected + dense_b
    torch.testing.assert_close(out, _mine(expected, 8, rank, world).transpose(0, 1), **TOL)
    assert {n for n, _ in layer.named_parameters()} == {"qkv_linear_weight", "qkv_linear_bias", "qkv_dense_weight",
                                                        "qkv_dense_bias"}


@pytest.mark.parametrize("return_bias", [True, False])
def test_fpdt_attention_layer_equals_full_layer(return_bias):
    run_distributed(_layer_matches, world_size=2, args=(return_bias,), timeout=60)


def test_fpdt_attention_rejects_bad_arguments():
    config = types.SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, kv_channels=4)
    with pytest.raises(ValueError, match="attention_dropout"):
        FPDT_Attention(config, torch.zeros(24, 8), None, torch.zeros(8, 8), None, None)
    config.attention_dropout = 0.0
    with pytest.raises(ValueError, match="rows"):
        FPDT_Attention(config, torch.zeros(20, 8), None, torch.zeros(8, 8), None, None)
    with pytest.raises(ValueError, match="attention_mask"):
        _FPDTGPUAttentionImpl_.apply(torch.zeros(4, 1, 8), torch.ones(1), None, None, None, 2, 0, 8, 8, 4, 8,
                                     torch.zeros(24, 8), None, 0.0, 1, False)


# ---------------------------------------------------------------- feed-forward and loss


@pytest.mark.parametrize("add_bias", [True, False])
def test_ffn_equals_unchunked_block(add_bias):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(12, 2, 6, generator=gen)
    params = [torch.randn(16, 6, generator=gen), torch.randn(16, generator=gen), torch.randn(6, 16, generator=gen),
              torch.randn(6, generator=gen)]
    upstream = torch.randn(12, 2, 6, generator=gen)
    ref = [t.clone().requires_grad_() for t in (x, *params)]
    expected = F.gelu(ref[0] @ ref[1].t() + ref[2], approximate="tanh") @ ref[3].t() + ref[4]
    expected.backward(upstream)
    mine = [t.clone().requires_grad_() for t in (x, *params)]
    out, bias = FPDT_FFN.apply(*mine, add_bias, 4)
    if not add_bias:  # the caller adds the returned bias; its gradient comes back through it
        out = out + bias
    out.backward(upstream)
    torch.testing.assert_close(out, expected, **TOL)
    for name, a, r in zip(("x", "w1", "b1", "w2", "b2"), mine, ref, strict=True):
        torch.testing.assert_close(a.grad, r.grad, **TOL, msg=f"d{name}")


def _loss_matches():
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(6)
    seq, vocab, hidden, chunk = 8, 11, 6, 4
    hidden_states = torch.randn(seq, BATCH, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen)
    labels = torch.randint(vocab, (BATCH, seq), generator=gen)
    labels[0, 3] = -100
    upstream = torch.randn(seq, BATCH, generator=gen)
    order = fpdt_token_order(seq, chunk, world)
    ref_h, ref_w = hidden_states.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = F.cross_entropy((ref_h @ ref_w.t()).flatten(0, 1), labels.t().reshape(-1), reduction="none")
    expected = expected.view(seq, BATCH)[order]  # gathered in FPDT order
    (expected * upstream).sum().backward()

    local_h = _mine(hidden_states.transpose(0, 1), chunk, rank, world).transpose(0, 1).clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = FPDT_LogitsLoss.apply(local_h, _mine(labels, chunk, rank, world), w, rank, world, dist.group.WORLD, 2)
    torch.testing.assert_close(loss, expected.detach(), **TOL)
    (loss * upstream).sum().backward()
    torch.testing.assert_close(local_h.grad, _mine(ref_h.grad.transpose(0, 1), chunk, rank, world).transpose(0, 1),
                               **TOL)
    grad_w = w.grad.clone()
    dist.all_reduce(grad_w)
    torch.testing.assert_close(grad_w, ref_w.grad, **TOL)


def test_logits_loss_two_ranks_equal_full_cross_entropy():
    run_distributed(_loss_matches, world_size=2, timeout=60)
