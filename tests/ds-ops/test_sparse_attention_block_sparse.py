"""Block-sparse attention (only the layout's blocks computed) against the masked dense reference: outputs and
gradients for every layout, with and without rpe / key padding / attention masks, chunked finely and coarsely;
and that its memory does not grow with L^2."""

from __future__ import annotations

import random

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from ds_ops.sparse_attention import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
    block_sparse_attention,
    layout_to_token_mask,
    make_plan,
    masked_dense_attention,
)

CONFIGS = {
    "dense": (lambda: DenseSparsityConfig(2, block=8), 48),
    "fixed": (lambda: FixedSparsityConfig(2, block=8, num_local_blocks=2), 64),
    "fixed_unidirectional": (lambda: FixedSparsityConfig(2, block=8, attention="unidirectional"), 80),
    "fixed_horizontal_per_head": (
        lambda: FixedSparsityConfig(2, block=8, different_layout_per_head=True, num_different_global_patterns=2,
                                    horizontal_global_attention=True, num_local_blocks=2), 48),
    "variable": (lambda: VariableSparsityConfig(2, block=8, num_random_blocks=1, local_window_blocks=[2, 3],
                                                global_block_indices=[0]), 64),
    "variable_unidirectional": (
        lambda: VariableSparsityConfig(2, block=8, local_window_blocks=[3], global_block_indices=[1],
                                       global_block_end_indices=[3], attention="unidirectional"), 64),
    "bigbird": (lambda: BigBirdSparsityConfig(2, block=8, different_layout_per_head=True, num_random_blocks=2), 64),
    "bigbird_unidirectional": (lambda: BigBirdSparsityConfig(2, block=8, num_random_blocks=1,
                                                             attention="unidirectional"), 64),
    "bslongformer": (lambda: BSLongformerSparsityConfig(2, block=8, num_sliding_window_blocks=3,
                                                        global_block_indices=[0, 5]), 64),
    "local_unidirectional": (lambda: LocalSlidingWindowSparsityConfig(2, block=8, num_sliding_window_blocks=3), 48),
    "local_bidirectional": (lambda: LocalSlidingWindowSparsityConfig(2, block=8, num_sliding_window_blocks=5,
                                                                     attention="bidirectional"), 48),
}


@pytest.fixture(autouse=True)
def _one_thread():
    """Many small ops: on a loaded 2-core machine each op's thread hand-off costs more than the op itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _case(name, masks, seed=0):
    random.seed(seed)
    torch.manual_seed(seed)
    make, seq = CONFIGS[name]
    config = make()
    layout = config.make_layout(seq)
    qkv = [torch.randn(2, 2, seq, 8, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    extra = {}
    if masks:
        keep = torch.ones(2, seq, dtype=torch.float64)
        keep[1, seq - 20:] = 0  # batch 1: the last 20 keys are padding
        extra = dict(rpe=torch.randn(1, 2, seq, seq, dtype=torch.float64, requires_grad=True),
                     key_padding_mask=keep, key_padding_mask_mode="mul",
                     attn_mask=torch.tril(torch.ones(seq, seq, dtype=torch.float64)), attn_mask_mode="mul")
    return config, layout, qkv, extra


def _run(fn, qkv, extra):
    for t in [*qkv, extra.get("rpe")]:
        if t is not None:
            t.grad = None
    out = fn(*qkv, **extra)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    (out * weight).sum().backward()
    grads = [t.grad.clone() for t in qkv]
    if extra.get("rpe") is not None:
        grads.append(extra["rpe"].grad.clone())
    return out.detach(), grads


@pytest.mark.parametrize("masks", [False, True], ids=["plain", "rpe_and_masks"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_block_sparse_equals_masked_dense_outputs_and_gradients(name, masks):
    config, layout, qkv, extra = _case(name, masks)
    scale = 8 ** -0.5
    token_mask = layout_to_token_mask(layout, config.block)
    ref_out, ref_grads = _run(lambda q, k, v, **kw: masked_dense_attention(q, k, v, token_mask, scale, **kw),
                              qkv, extra)
    plan = make_plan(layout, config.block)
    assert plan.nnz_blocks == int(layout.bool().sum())
    for chunk_elements in (1, 1 << 20):  # every piece its own chunk; everything in one
        out, grads = _run(lambda q, k, v, ce=chunk_elements, **kw: block_sparse_attention(
            q, k, v, plan, scale, chunk_elements=ce, **kw), qkv, extra)
        torch.testing.assert_close(out, ref_out)
        assert len(grads) == len(ref_grads)
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want)
    if masks:  # the module gives the same (and masks with an empty row do not produce NaN)
        module = SparseSelfAttention(config, key_padding_mask_mode="mul", attn_mask_mode="mul",
                                     max_seq_length=layout.shape[-1] * config.block)
        module.master_layout.copy_(layout)
        got, _ = _run(lambda q, k, v, **kw: module(q, k, v, rpe=kw["rpe"], key_padding_mask=kw["key_padding_mask"],
                                                   attn_mask=kw["attn_mask"]), qkv, extra)
        torch.testing.assert_close(got, ref_out)


def test_rows_with_nothing_to_attend_give_zero_and_no_gradient():
    layout = torch.ones(1, 4, 4, dtype=torch.int64)
    layout[0, 2] = 0  # block row 2 attends nothing
    qkv = [torch.randn(1, 1, 32, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    keep = torch.ones(1, 32, dtype=torch.float64)
    keep[0, :8] = 0
    attn_mask = torch.ones(32, 32, dtype=torch.float64)
    attn_mask[0:8, 8:] = 0  # with the padding, query block 0 sees nothing either
    extra = dict(key_padding_mask=keep, key_padding_mask_mode="mul", attn_mask=attn_mask)
    out, grads = _run(lambda q, k, v, **kw: block_sparse_attention(q, k, v, make_plan(layout, 8), 0.5, **kw),
                      qkv, extra)
    ref_out, ref_grads = _run(lambda q, k, v, **kw: masked_dense_attention(
        q, k, v, layout_to_token_mask(layout, 8), 0.5, **kw), qkv, extra)
    assert out[0, 0, 16:24].eq(0).all() and out[0, 0, :8].eq(0).all()
    assert grads[0][0, 0, 16:24].eq(0).all() and grads[0][0, 0, :8].eq(0).all()
    torch.testing.assert_close(out, ref_out)
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)


def test_plan_groups_rows_that_share_columns_and_respects_the_chunk_budget():
    layout = FixedSparsityConfig(2, block=16, num_local_blocks=4).make_layout(512)  # 32 blocks, 8 windows
    plan = make_plan(layout, 16)
    # bidirectional Fixed: the 4 rows of a window see the same columns (window + every global): one group each
    assert len(plan.groups) == 2 * 8 and all(len(g.rows) == 4 for g in plan.groups)
    assert {len(g.cols) for g in plan.groups} == {4 + 7}
    budget = 2 * 11 * 16 * 16 * 2  # two rows of 11 blocks, batch 2
    chunks = plan.chunks(2, budget)
    covered = sorted((int(h), int(r)) for c in chunks for h, rows in zip(c.heads, c.rows, strict=True) for r in rows)
    assert covered == [(h, r) for h in range(2) for r in range(32)]  # every row once
    assert all(2 * c.rows.numel() * c.cols.shape[1] * 16 * 16 <= budget for c in chunks)


def test_low_precision_inputs_compute_in_float32_and_return_their_dtype():
    config = BigBirdSparsityConfig(2, block=16, num_random_blocks=1)
    layout = config.make_layout(128)
    q, k, v = (torch.randn(1, 2, 128, 16).to(torch.bfloat16) for _ in range(3))
    out = block_sparse_attention(q, k, v, make_plan(layout, 16), 0.25)
    ref = masked_dense_attention(q, k, v, layout_to_token_mask(layout, 16), 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_argument_errors_name_the_argument():
    plan = make_plan(FixedSparsityConfig(2, block=8).make_layout(32), 8)
    q = torch.randn(1, 2, 32, 4)
    with pytest.raises(ValueError, match="does not fit the layout"):
        block_sparse_attention(torch.randn(1, 3, 32, 4), q, q, plan, 1.0)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \[B, L\]"):
        block_sparse_attention(q, q, q, plan, 1.0, key_padding_mask=torch.ones(1, 31))
    with pytest.raises(ValueError, match=r"attn_mask must be \[L, L\]"):
        block_sparse_attention(q, q, q, plan, 1.0, attn_mask=torch.ones(32, 30))
    with pytest.raises(ValueError, match="rpe must be broadcastable"):
        block_sparse_attention(q, q, q, plan, 1.0, rpe=torch.ones(32, 31))
    with pytest.raises(ValueError, match="chunk_elements must be a positive"):
        block_sparse_attention(q, q, q, plan, 1.0, chunk_elements=0)
    with pytest.raises(ValueError, match="layout must be"):
        make_plan(torch.ones(4, 4), 8)


def _peak_bytes(fn) -> int:
    """Peak of torch's CPU allocator total during fn, relative to its start (the profiler's allocation events)."""
    samples = []  # (time, allocator total after the event, bytes of the event: < 0 for a free)

    def walk(events):
        for e in events:
            if e.tag == _EventType.Allocation:
                samples.append((e.start_time_ns, e.extra_fields.total_allocated, e.extra_fields.alloc_size))
            walk(e.children)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    walk(prof.profiler.kineto_results.experimental_event_tree())
    if not samples:
        return 0
    samples.sort()
    # the allocator's total counts what earlier tests in this process still hold: measure from fn's start
    start = samples[0][1] - samples[0][2]
    return max(0, max(total for _, total, _ in samples) - start)


def test_memory_grows_with_the_kept_blocks_not_with_l_squared():
    seq, block = 1024, 16
    config = FixedSparsityConfig(2, block=block, num_local_blocks=8)
    layout = config.make_layout(seq)
    plan = make_plan(layout, block)
    qkv = [torch.randn(1, 2, seq, 16, dtype=torch.float32, requires_grad=True) for _ in range(3)]

    def step(fn):
        return lambda: fn(*qkv).sum().backward()

    def sparse(q, k, v):
        return block_sparse_attention(q, k, v, plan, 0.25, chunk_elements=1 << 14)

    step(sparse)()  # warm up
    peak = _peak_bytes(step(sparse))
    scores_bytes = 2 * seq * seq * 4  # one [B, H, L, L] fp32 tensor
    dense_peak = _peak_bytes(step(lambda q, k, v: masked_dense_attention(
        q, k, v, layout_to_token_mask(layout, block), 0.25)))
    assert dense_peak > 2 * scores_bytes
    # inputs' gradients and output (4 x 256 KiB) plus one chunk's work space: a small part of one score matrix
    assert peak < scores_bytes / 8, (peak, scores_bytes)
