"""ds_inference.quantization: per-group int8 weight quantization obeys its error bound and saves the bytes."""

from __future__ import annotations

import copy
import functools
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.pytorch_utils import Conv1D

import ds_inference.quantization as quantization
from ds_inference.quantization import (
    QuantizedWeight,
    dequantize,
    dequantize_rows,
    is_quantized,
    model_bytes,
    quantize,
    quantize_weights,
    quantized_matmul,
    quantized_matmul_reference,
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
def test_linear_and_embedding_weights_dequantized_on_the_fly_tied_ones_shared():
    torch.manual_seed(0)
    emb = nn.Embedding(16, 64)
    head = nn.Linear(64, 16, bias=False)
    head.weight = emb.weight  # tied: quantized once, the int8 buffers shared by both modules
    model = nn.Sequential(emb, nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64), head)
    before = model_bytes(model)
    ids = torch.randint(0, 16, (3, 5))
    expected = model(ids)
    names = quantize_weights(model, 8, groups=4)
    assert names == ["0", "1", "3", "5"] and all(is_quantized(model[int(n)]) for n in names)
    assert model[5].weight_q is model[0].weight_q and model[5].weight_scale is model[0].weight_scale
    assert [n for n, _ in model.named_parameters()] == ["1.bias", "3.bias", "4.weight", "4.bias"]
    after = model_bytes(model)
    # 2 x 16384 + 1024 fp32 weights -> int8 + 4 fp32 scales each (the tied one counted once); the rest unchanged
    assert before - after == 2 * (16384 * 3 - 4 * 4) + (1024 * 3 - 4 * 4)
    got = model(ids)
    assert all(model[i].weight is None for i in (0, 1, 3, 5))  # the float weight only lives while its layer runs
    assert 0 < (got - expected).abs().max().item() < 0.02 * expected.abs().max().item()  # measured ~0.8%
    assert quantize_weights(model) == []  # idempotent
    # an embedding lookup comes back in the table's own dtype (its int64 input carries none)
    half = nn.Embedding(8, 4).half()
    quantize_weights(half)
    assert half(torch.tensor([1, 2])).dtype == torch.float16


@torch.no_grad()
def test_embedding_lookup_dequantizes_only_its_rows_exactly():
    torch.manual_seed(0)
    emb = nn.Embedding(12, 6, padding_idx=11)
    # 72 elements in 24 groups of 3: the groups do not align with the rows of 6
    qw = quantize(emb.weight, 8, 24, "asymmetric")
    ids = torch.tensor([[11, 3, 3], [0, 7, 11]])
    assert torch.equal(dequantize_rows(qw, torch.tensor([0, 3, 11])), dequantize(qw)[[0, 3, 11]])
    quantize_weights(emb, 8, groups=24, q_type="asymmetric")
    assert torch.equal(emb(ids), torch.nn.functional.embedding(ids, dequantize(qw)))
    assert emb.padding_idx == 11 and emb.weight is None  # restored / dropped after the lookup
    with pytest.raises(IndexError, match=r"ids must be in \[0, 12\), got -1..3"):
        emb(torch.tensor([3, -1]))


def test_weights_that_must_stay_float_and_errors_name_the_module():
    shared = nn.Linear(4, 4)
    other = nn.Module()
    other.kernel = shared.weight  # the same tensor under another name: quantizing it would break ``other``
    renorm = nn.Embedding(8, 4, max_norm=1.0)  # renormalises its stored rows in place on lookup
    model = nn.ModuleDict({"shared": shared, "other": other, "renorm": renorm, "odd": nn.Linear(3, 3)})
    assert quantize_weights(model, groups=1) == ["odd"]
    assert not is_quantized(shared) and not is_quantized(renorm)
    whole = nn.ModuleDict({"even": nn.Linear(4, 4), "odd": nn.Linear(3, 3)})
    with pytest.raises(ValueError, match=r"^odd: quant.weight.q_groups=2 must divide the weight's 9 elements"):
        quantize_weights(whole, groups=2)
    assert not is_quantized(whole["even"])  # checked before anything was replaced: the model is left whole


# (rows, cols, groups): groups of 4 and of 2 whole rows, one per row, 3 per row, one for all (tiles inside it),
# and 6 groups of 10 elements that straddle rows of 12 unevenly (the tiled path falls back to the reference)
LAYOUTS = [(32, 12, 8), (32, 12, 16), (32, 12, 32), (32, 12, 96), (32, 12, 1), (5, 12, 6)]


@pytest.mark.parametrize("rows,cols,groups", LAYOUTS)
@pytest.mark.parametrize("q_type", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("transposed", [False, True])
def test_tiled_matmul_equals_the_reference(monkeypatch, rows, cols, groups, q_type, transposed):
    monkeypatch.setattr(quantization, "TILE_ELEMENTS", 5 * cols)  # tiles of 5 rows: several, the last one short
    gen = torch.Generator().manual_seed(rows * groups)
    qw = quantize(torch.randn(rows, cols, generator=gen) + 0.3, 8, groups, q_type)
    x = torch.randn(2, 3, rows if transposed else cols, generator=gen)
    expected = quantized_matmul_reference(x, qw, transposed)
    assert torch.allclose(expected, x @ dequantize(qw) if transposed else x @ dequantize(qw).t())
    got = quantized_matmul(x, qw, transposed)
    assert got.shape == expected.shape == (2, 3, cols if transposed else rows)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    half = quantized_matmul(x.bfloat16(), qw, transposed)  # computed in the activation dtype
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), expected, rtol=0.05, atol=0.02 * expected.abs().max().item())


def _tiny_lm(vocab: int = 40, hidden: int = 16) -> nn.Module:
    torch.manual_seed(0)
    emb, head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab, bias=False)
    head.weight = emb.weight  # the tied lm_head: its codes are the embedding's
    return nn.Sequential(emb, Conv1D(4 * hidden, hidden), nn.GELU(), nn.Linear(4 * hidden, hidden), head)


@torch.no_grad()
@pytest.mark.parametrize("q_type,groups", [("symmetric", 16), ("asymmetric", 16), ("symmetric", 128)])
def test_model_fast_path_equals_reference_path_tied_head_included(q_type, groups):
    model = _tiny_lm()
    ids = torch.randint(0, 40, (2, 7))
    fp32 = model(ids)
    quantize_weights(model, 8, groups, q_type)
    fast = [m for m in model if isinstance(getattr(m, "forward", None), functools.partial)]
    assert fast == [model[1], model[3], model[4]]  # Conv1D, Linear and the tied head; the embedding looks up rows
    got = model(ids)
    for module in fast:
        module._tiled_matmul = False
    reference = model(ids)
    assert all(m.weight is None for m in model if is_quantized(m))
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
    assert 0 < (got - fp32).abs().max() < 0.02 * fp32.abs().max()  # still the int8 model, not the float one
    for module in fast:
        module._tiled_matmul = True
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):  # the instance forward travels along
        assert clone[4].weight_q is clone[0].weight_q
        torch.testing.assert_close(clone(ids), got, rtol=0, atol=0)
