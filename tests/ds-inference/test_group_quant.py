"""Group-wise INT4/INT8 weight quantization (deepspeed.inference.quantization): quantizer error bounds and
packing, the packed parameter format, quantized layers, and model conversion by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_inference.group_quant import layers
from ds_inference.group_quant.layers import QuantizedEmbedding, QuantizedLinear
from ds_inference.group_quant.quantization import _init_group_wise_weight_quantization
from ds_inference.group_quant.utils import (
    DeQuantizer,
    Quantizer,
    concat_to_compat_param,
    dequantized_weight,
    wrap_load_from_state_dict,
    wrap_quantized_functional,
)


def config(bits=8, size=16, dim=1):
    return {"num_bits": bits, "group_size": size, "group_dim": dim, "symmetric": False}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_error_is_within_half_a_step_of_each_group(bits, dim, dtype):
    torch.manual_seed(0)
    data = (torch.randn(32, 48) * torch.logspace(-2, 2, 48)).to(dtype)
    cfg = config(bits, 16, dim)
    codes, scale, low = Quantizer(cfg).quantize(data)
    assert codes.dtype == torch.uint8 and codes.shape == ((32, 24) if bits == 4 else (32, 48))
    assert scale.dtype == low.dtype == dtype
    back = DeQuantizer(cfg, dtype).dequantize(codes, scale, low)
    assert back.shape == data.shape and back.dtype == dtype
    def per_value(group_values):  # one value per group -> one per element
        return group_values.repeat_interleave(16, dim=dim + 1).reshape(data.shape)

    step = per_value(1 / scale.float())
    grouped = data.float().reshape(scale.shape[:dim + 1] + (16,) + scale.shape[dim + 2:])
    magnitude = per_value(grouped.abs().amax(dim=dim + 1, keepdim=True))
    # scale and minimum are kept in the data's dtype: their rounding adds about one ulp of the group's magnitude
    slack = magnitude * (1e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps)
    assert ((back.float() - data.float()).abs() <= step / 2 + slack).all()


def test_int4_packing_and_constant_groups():
    cfg = config(4, 4, 1)
    data = torch.tensor([[0.0, 1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 5.0]])
    codes, scale, low = Quantizer(cfg).quantize(data)
    # first group: (x - 0) * 15 / 3 -> 0, 5, 10, 15 packed high/low; second group constant: codes 0, scale 1
    assert codes.tolist() == [[0x05, 0xAF, 0x00, 0x00]] and scale.flatten().tolist() == [5.0, 1.0]
    torch.testing.assert_close(DeQuantizer(cfg, torch.float32).dequantize(codes, scale, low), data)


@pytest.mark.parametrize("bad, match", [({"num_bits": 3}, "num_bits=3"), ({"symmetric": True}, "symmetric=True"),
                                        ({"group_size": 5}, "group_size=5 along group_dim=1")])
def test_bad_configs_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        Quantizer({**config(), **bad}).quantize(torch.randn(4, 16))


def test_compat_param_round_trip_with_odd_code_count():
    cfg = config(4, 2, 1)
    data = torch.randn(3, 6, dtype=torch.float16)
    codes, scale, low = Quantizer(cfg).quantize(data)  # 9 code bytes: padded to whole fp16 elements
    packed = concat_to_compat_param(codes, scale, low)
    assert isinstance(packed, nn.Parameter) and packed.dtype == torch.float16 and not packed.requires_grad
    got = packed.deconcat(packed)
    for a, b in zip(got, (codes, scale, low), strict=True):
        assert torch.equal(a, b)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)
        self.head = nn.Linear(32, 10, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(self.fc2(F.relu(self.fc1(h))))


def test_model_conversion_by_name_shares_tied_weights():
    torch.manual_seed(0)
    model = Block()
    ids = torch.tensor([[1, 2, 3, 9]])
    ref = model(ids)
    quant = {"weight_quantization": {"post_init_quant": {"fc": config(8, 32, 1), "embed": config(8, 32, 1),
                                                         "head": config(8, 32, 1)}}}
    out_model = _init_group_wise_weight_quantization(model, quant)
    assert out_model is model and type(model.fc1) is QuantizedLinear and type(model.fc2) is QuantizedLinear
    assert type(model.embed) is QuantizedEmbedding and type(model.head) is QuantizedLinear
    assert model.head.weight is model.embed.weight  # quantized once, shared
    assert model.fc1.bias is not None and not layers.quantized_weight_registry
    assert sum(p.numel() * p.element_size() for p in model.parameters()) < 0.4 * 4 * (10 * 32 + 32 * 64 * 2)
    torch.testing.assert_close(model(ids), ref, atol=0.05, rtol=0.05)


def test_conversion_errors():
    with pytest.raises(ValueError, match="post_init_quant"):
        _init_group_wise_weight_quantization(Block(), {})
    with pytest.raises(ValueError, match="several .* keys"):
        _init_group_wise_weight_quantization(Block(), {"weight_quantization": {"post_init_quant": {
            "fc": config(), "fc1": config()}}})
    with pytest.raises(ValueError, match="stage 3"):
        _init_group_wise_weight_quantization(Block(), {"zero_optimization": {"stage": 3}, "weight_quantization": {
            "post_init_quant": {"fc": config()}}})


def test_functional_and_state_dict_wrappers():
    from ds_inference.group_quant.utils import _quantize_param

    torch.manual_seed(0)
    layer = nn.Linear(16, 4, bias=False)
    x = torch.randn(2, 16)
    _quantize_param(layer.weight, config(8, 16, 1))
    linear = wrap_quantized_functional(F.linear)
    torch.testing.assert_close(linear(x, layer.weight), F.linear(x, dequantized_weight(layer.weight)))
    new_weight = torch.randn(4, 16)
    load = wrap_load_from_state_dict(nn.Linear._load_from_state_dict)
    state = {"weight": new_weight}
    load(layer, state, "", {}, True, [], [], [])
    assert state["weight"] is new_weight  # the caller's state dict is left as it was
    torch.testing.assert_close(dequantized_weight(layer.weight), new_weight, atol=0.02, rtol=0.02)
