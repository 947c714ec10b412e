"""ds_inference.quantization: per-group int8 weight quantization obeys its error bound and saves the bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ds_inference.quantization import (
    QuantizedWeight,
    dequantize,
    is_quantized,
    model_bytes,
    quantize,
    quantize_linear_weights,
)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 16), cols=st.integers(1, 24), bits=st.integers(2, 8), seed=st.integers(0, 2**16),
       scale=st.floats(1e-4, 1e3), group_rows=st.booleans())
def test_symmetric_error_is_at_most_half_a_step_per_group(rows, cols, bits, seed, scale, group_rows):
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * scale
    groups = rows if group_rows else 1
    qw = quantize(weight, bits, groups)
    qmax = 2 ** (bits - 1) - 1
    assert qw.q.dtype == torch.int8 and qw.q.shape == weight.shape and qw.scale.shape == (groups, 1)
    assert qw.q.abs().max() <= qmax
    step = weight.reshape(groups, -1).abs().amax(dim=1, keepdim=True) / qmax  # the group's scale
    err = (dequantize(qw) - weight).reshape(groups, -1).abs()
    assert torch.all(err <= step / 2 * (1 + 1e-5) + 1e-12)


@settings(max_examples=30, deadline=None)
@given(bits=st.integers(2, 8), seed=st.integers(0, 2**16), shift=st.floats(-5, 5))
def test_asymmetric_error_bound_and_code_range(bits, seed, shift):
    weight = torch.rand(8, 6, generator=torch.Generator().manual_seed(seed)) + shift
    qw = quantize(weight, bits, groups=4, q_type="asymmetric")
    assert qw.zero is not None and qw.q.min() >= -(2 ** (bits - 1)) and qw.q.max() <= 2 ** (bits - 1) - 1
    flat = weight.reshape(4, -1)
    step = (flat.amax(1, keepdim=True) - flat.amin(1, keepdim=True)) / (2**bits - 1)
    assert torch.all((dequantize(qw) - weight).reshape(4, -1).abs() <= step / 2 * (1 + 1e-4) + 1e-6)


def test_more_groups_never_hurt_and_zero_weights_survive():
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    weight[0] *= 50  # one outlier row: a single scale wastes precision on every other row
    errors = [(dequantize(quantize(weight, 8, g)) - weight).abs().mean().item() for g in (1, 8, 64)]
    assert errors[0] > errors[1] > errors[2]
    zeros = quantize(torch.zeros(4, 4), 8, 2)
    assert torch.equal(dequantize(zeros), torch.zeros(4, 4))
    assert dequantize(QuantizedWeight(zeros.q, zeros.scale, None), torch.bfloat16).dtype == torch.bfloat16


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match=r"q_groups=3 must divide the weight's 16 elements"):
        quantize(torch.ones(4, 4), 8, 3)
    with pytest.raises(ValueError, match="num_bits=9"):
        quantize(torch.ones(4, 4), 9, 1)
    with pytest.raises(ValueError, match="q_type='nf4'"):
        quantize(torch.ones(4, 4), 8, 1, "nf4")


@torch.no_grad()
def test_linear_weights_dequantized_on_the_fly_tied_weights_kept():
    torch.manual_seed(0)
    emb = nn.Embedding(16, 64)
    head = nn.Linear(64, 16, bias=False)
    head.weight = emb.weight  # tied: stays float
    model = nn.Sequential(emb, nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64), head)
    before = model_bytes(model)
    ids = torch.randint(0, 16, (3, 5))
    expected = model(ids)
    names = quantize_linear_weights(model, 8, groups=4)
    assert names == ["1", "3"] and is_quantized(model[1]) and not is_quantized(model[5])
    assert "weight" not in dict(model[1].named_parameters()) and model[5].weight is model[0].weight
    after = model_bytes(model)
    # 2 x 16384 fp32 weights -> int8 + 4 scales each; the rest (embedding, biases, norm) unchanged
    assert before - after == 2 * (16384 * 3 - 4 * 4)
    got = model(ids)
    assert not hasattr(model[1], "weight")  # the float weight only lives while the layer runs
    assert 0 < (got - expected).abs().max().item() < 0.02 * expected.abs().max().item()  # measured ~0.8%
    assert quantize_linear_weights(model) == []  # idempotent
