"""Per op family: the profiler's MACs/FLOPs against hand-computed formulas (FLOPs = 2 x MACs for
multiply-accumulate ops; bias adds fused into matmul/conv are not counted)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


def mac(n: int) -> tuple[int, int]:
    return n, 2 * n


@pytest.mark.parametrize("shape", [(5, 8), (2, 5, 8), (2, 3, 5, 8)])
def test_linear_counts_input_rows_times_in_times_out(shape, count):
    rows = 1
    for d in shape[:-1]:
        rows *= d
    assert count(nn.Linear(8, 6), torch.randn(shape)) == mac(rows * 8 * 6)
    assert count(nn.Linear(8, 6, bias=False), torch.randn(shape)) == mac(rows * 8 * 6)


def test_matmul_family_through_functions_methods_and_operators(count):
    a, b = torch.randn(4, 6), torch.randn(6, 3)
    assert count(lambda x, y: x @ y, a, b) == mac(4 * 6 * 3)
    assert count(torch.mm, a, b) == mac(4 * 6 * 3)
    assert count(lambda x, y: x.matmul(y), a, b) == mac(4 * 6 * 3)
    assert count(lambda x, y: torch.addmm(torch.zeros(3), x, y), a, b) == mac(4 * 6 * 3)
    x, y = torch.randn(2, 4, 6), torch.randn(2, 6, 3)
    assert count(torch.bmm, x, y) == mac(2 * 4 * 6 * 3)
    assert count(lambda p, q: torch.baddbmm(torch.zeros(2, 4, 3), p, q), x, y) == mac(2 * 4 * 6 * 3)
    assert count(lambda p, q: torch.einsum("bij,bjk->bik", p, q), x, y) == mac(2 * 4 * 6 * 3)
    assert count(torch.mv, a, torch.randn(6)) == mac(24)
    assert count(torch.dot, torch.randn(7), torch.randn(7)) == mac(7)


@pytest.mark.parametrize(
    "conv, shape",
    [
        (nn.Conv1d(4, 6, 3, stride=2, padding=1), (2, 4, 9)),
        (nn.Conv2d(4, 6, (3, 2), dilation=2, groups=2), (2, 4, 9, 8)),
        (nn.Conv3d(2, 4, 3, padding=1, bias=False), (1, 2, 5, 4, 4)),
    ],
)
def test_convolution_counts_output_positions_times_kernel_volume(conv, shape, count):
    out = conv(torch.randn(shape))
    per_position = (conv.in_channels // conv.groups) * int(torch.tensor(conv.kernel_size).prod())
    assert count(conv, torch.randn(shape)) == mac(out.numel() * per_position)


@pytest.mark.parametrize(
    "conv, shape",
    [
        (nn.ConvTranspose1d(4, 6, 3, stride=2), (2, 4, 5)),
        (nn.ConvTranspose2d(4, 6, 3, groups=2), (1, 4, 5, 5)),
        (nn.ConvTranspose3d(2, 3, 2), (1, 2, 3, 3, 3)),
    ],
)
def test_transposed_convolution_counts_input_positions(conv, shape, count):
    x = torch.randn(shape)
    per_position = (conv.out_channels // conv.groups) * int(torch.tensor(conv.kernel_size).prod())
    assert count(conv, x) == mac(x.numel() * per_position)


@pytest.mark.parametrize("value_dim", [8, 4])  # 8: torch's fused CPU kernel; 4: its math fallback
@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"attn_mask": torch.ones(7, 7, dtype=torch.bool)}])
def test_sdpa_counts_dense_scores_with_and_without_causal_mask(kwargs, value_dim, count):
    q, k, v = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, value_dim)
    rows, keys = 2 * 3 * 7, 7
    macs = rows * keys * (8 + value_dim)
    softmax, mask, scaling = rows * keys, rows * keys if kwargs else 0, q.numel() + k.numel()
    got = count(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, **kwargs), q, k, v)
    assert got == (macs, 2 * macs + softmax + mask + scaling)


def test_fused_bshd_attention_kernels_count_like_sdpa():
    from ds_profiler._rules_dense import efficient_bshd_rule, flash_bshd_rule

    q, k, v = torch.randn(2, 7, 3, 8), torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3, 8)
    macs = 2 * 3 * 7 * 5 * 16
    plain = (macs, 2 * macs + 2 * 3 * 7 * 5 + q.numel() + k.numel())
    assert flash_bshd_rule((q, k, v, None, None, 7, 5, 0.0, False, False), {}, None) == plain
    assert efficient_bshd_rule((q, k, v, None, None, None, 7, 5, 0.0, 0), {}, None) == plain
    # variable-length packing: sequences of (3 queries, 2 keys) and (4, 3)
    cum_q, cum_k = torch.tensor([0, 3, 7]), torch.tensor([0, 2, 5])
    packed = flash_bshd_rule((q[0], k[0], v[0], cum_q, cum_k, 4, 3, 0.0, True, False), {}, None)
    pairs = 3 * 2 + 4 * 3
    assert packed[0] == pairs * 3 * 16


def test_normalizations(count):
    x = torch.randn(4, 6, 10)
    assert count(nn.LayerNorm(10), x) == (0, 5 * x.numel())
    assert count(nn.LayerNorm(10, elementwise_affine=False), x) == (0, 4 * x.numel())
    assert count(nn.GroupNorm(3, 6), x) == (0, 5 * x.numel())
    assert count(nn.GroupNorm(3, 6, affine=False), x) == (0, 4 * x.numel())
    assert count(nn.BatchNorm1d(6), x) == (0, 5 * x.numel())
    assert count(nn.BatchNorm1d(6).eval(), x) == (0, 2 * x.numel())
    assert count(nn.BatchNorm1d(6, affine=False).eval(), x) == (0, 1 * x.numel())
    assert count(nn.InstanceNorm1d(6), x) == (0, 4 * x.numel())
    rows = x.numel() // 10
    assert count(nn.RMSNorm(10), x) == (0, 4 * x.numel() + 2 * rows)
    assert count(nn.RMSNorm(10, elementwise_affine=False), x) == (0, 3 * x.numel() + 2 * rows)


@pytest.mark.parametrize(
    "fn",
    [F.relu, F.gelu, F.silu, torch.sigmoid, torch.tanh, F.leaky_relu, F.elu, F.hardswish, F.mish, F.softplus,
     lambda t: F.softmax(t, -1), lambda t: F.log_softmax(t, -1), torch.exp, torch.rsqrt, lambda t: t.abs()],
)
def test_activations_softmax_and_unary_ops_cost_one_flop_per_element(fn, count):
    x = torch.rand(3, 5, 7) + 0.1
    assert count(fn, x) == (0, x.numel())


def test_elementwise_arithmetic_counts_output_elements_incl_broadcast_and_inplace(count):
    a, b = torch.randn(4, 5), torch.randn(5)
    assert count(lambda x, y: x * y + y, a, b) == (0, 2 * 20)
    assert count(lambda x, y: x.add_(y).mul_(2.0), a.clone(), b) == (0, 2 * 20)
    assert count(lambda x, y: torch.sub(x, y) / 3, a, b) == (0, 2 * 20)
    ints = torch.arange(20).view(4, 5)
    assert count(lambda x: (x + 1) * 2, ints) == (0, 0)  # integer arithmetic is not floating-point work


def test_reductions_cost_one_flop_per_input_element(count):
    x = torch.randn(4, 6)
    assert count(lambda t: t.sum(), x) == (0, 24)
    assert count(lambda t: t.mean(-1), x) == (0, 24)
    assert count(lambda t: t.max(dim=0).values, x) == (0, 24)
    assert count(lambda t: t.var(-1), x) == (0, 48)


def test_pooling_costs_one_flop_per_input_element(count):
    x = torch.randn(2, 3, 8, 8)
    assert count(nn.MaxPool2d(2), x) == (0, x.numel())
    assert count(nn.AvgPool2d(2), x) == (0, x.numel())
    assert count(nn.AdaptiveAvgPool2d(1), x) == (0, x.numel())
    assert count(lambda t: F.adaptive_avg_pool1d(t, 2), x[0]) == (0, x[0].numel())
    assert count(nn.MaxPool1d(2), x[0]) == (0, x[0].numel())


def test_interpolation(count):
    x = torch.randn(1, 2, 4, 4)
    out = 1 * 2 * 8 * 8
    assert count(lambda t: F.interpolate(t, scale_factor=2), x) == (0, out)
    assert count(lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), x) == (0, out * 2 * 4)
    assert count(nn.Upsample(size=(6, 6), mode="bicubic"), x) == (0, 2 * 36 * 2 * 16)
    assert count(lambda t: F.interpolate(t, scale_factor=2, mode="linear"), x[0]) == (0, 2 * 4 * 8 * 2 * 2)


def test_embedding_is_free_and_dropout_costs_only_in_training(count):
    ids = torch.randint(0, 10, (3, 4))
    assert count(nn.Embedding(10, 6), ids) == (0, 0)
    x = torch.randn(4, 5)
    assert count(nn.Dropout(0.5), x) == (0, 2 * 20)
    assert count(nn.Dropout(0.5).eval(), x) == (0, 0)


def _recurrent_expected(kind: str, steps_rows: int, layers_dirs: list[tuple[int, int]], hidden: int) -> tuple:
    gates = {"rnn": 1, "lstm": 4, "gru": 3}[kind]
    pointwise = {"rnn": 2, "lstm": 13, "gru": 10}[kind]
    macs = sum(steps_rows * gates * hidden * (inp + hidden) for inp, _ in layers_dirs)
    return macs, 2 * macs + steps_rows * len(layers_dirs) * hidden * pointwise


@pytest.mark.parametrize("kind, cls", [("rnn", nn.RNN), ("lstm", nn.LSTM), ("gru", nn.GRU)])
def test_recurrent_modules(kind, cls, count):
    x = torch.randn(5, 3, 4)  # (steps, batch, features)
    assert count(cls(4, 6), x) == _recurrent_expected(kind, 15, [(4, 1)], 6)
    # bias=False: torch runs layer 2's input projection of a bidirectional stack as matmul + a separate bias
    # add (non-contiguous input), and that add would be counted as elementwise work.
    two_layer_bi = cls(4, 6, num_layers=2, bidirectional=True, batch_first=True, bias=False)
    cells = [(4, 1), (4, 1), (12, 1), (12, 1)]
    assert count(two_layer_bi, x) == _recurrent_expected(kind, 15, cells, 6)


def test_fused_recurrent_formulas_match_the_decomposed_path():
    from ds_profiler._rules_dense import cudnn_rnn_rule, mkldnn_rnn_rule

    x, w_ih, w_hh = torch.randn(5, 3, 4), torch.randn(24, 4), torch.randn(24, 6)
    expected = _recurrent_expected("lstm", 15, [(4, 1)], 6)
    mk_args = (x, w_ih, w_hh, None, None, None, None, False, [], 2, 6, 1, False, False, False, False)
    assert mkldnn_rnn_rule(mk_args, {}, None) == expected
    cudnn_args = (x, [w_ih, w_hh, torch.zeros(24), torch.zeros(24)], 4, None, None, None, 2, 6, 0, 1, False, 0.0,
                  False, False, [], None)
    assert cudnn_rnn_rule(cudnn_args, {}, None) == expected


def test_native_multihead_attention_fast_path_matches_unfused_module(count):
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    fused = count(lambda t: mha(t, t, t, need_weights=False)[0], x)
    proj = 2 * 5 * 16 * 16 * 4
    attn = 2 * 4 * 5 * 5 * 2 * 4
    assert fused[0] == proj + attn


def test_op_plans_are_cached_per_overload_and_free_ops_have_no_rule():
    from ds_profiler._counter import plan_for

    addmm, view = torch.ops.aten.addmm.default, torch.ops.aten.view.default
    plan = plan_for(addmm)
    assert plan_for(addmm) is plan
    assert plan[0] is addmm and plan[2] is not None and plan[3] == "aten.addmm" and not plan[1]
    assert plan_for(view)[2] is None  # a view costs nothing: the mode runs it without pricing
    assert plan_for(torch.ops.aten.linear.default)[1]  # composite: decomposed when it arrives whole


def test_repeated_forwards_count_the_same(count):
    # The plan cache must not change what the second and later calls of an op cost.
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))
    x = torch.randn(3, 8)
    assert count(model, x) == count(model, x) == (3 * 64, 2 * 3 * 64 + 3 * 8 + 5 * 3 * 8)
