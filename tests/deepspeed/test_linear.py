"""deepspeed.linear: LoRA layers over a frozen base weight (sharded across gloo ranks or whole, FP8 or not),
deepspeed.linear.Init and init_lora, the FP8 group quantizer, and the configs' checks."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import distributed_test

import deepspeed
from deepspeed.linear import (
    LoRAConfig,
    LoRAOptimizedLinear,
    OptimizedLinear,
    QuantizationConfig,
    QuantizedLinear,
    QuantizedParameter,
    init_lora,
)
from deepspeed.linear.quantization import dequantize, quantize


def test_lora_layer_starts_at_its_base_and_trains_only_adapters():
    torch.manual_seed(0)
    layer = OptimizedLinear(8, 6, lora_config=LoRAConfig(lora_r=4, lora_alpha=8), dtype=torch.float32)
    assert isinstance(layer, LoRAOptimizedLinear) and layer.weight.shape == (6, 8)
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))  # B starts at zero
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["lora_weight_1.weight",
                                                                           "lora_weight_2.weight"]
    with torch.no_grad():
        layer.lora_weight_2.weight.normal_()
    a, b = layer.lora_weight_1.weight, layer.lora_weight_2.weight
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight) + 2.0 * x @ a.t() @ b.t())
    layer(x).sum().backward()
    assert layer.weight.grad is None and a.grad is not None


def test_optimized_linear_dispatch_and_errors():
    plain = OptimizedLinear(4, 2, dtype=torch.float32)
    assert type(plain) is torch.nn.Linear and plain.bias is None
    assert isinstance(OptimizedLinear(4, 2, quantization_config=QuantizationConfig(group_size=4)), QuantizedLinear)
    with pytest.raises(ValueError, match="lora_config: expected a LoRAConfig"):
        OptimizedLinear(4, 2, lora_config={"lora_r": 2})
    with pytest.raises(ValueError, match="bias=True"):
        OptimizedLinear(4, 2, bias=True, lora_config=LoRAConfig())
    with pytest.raises(ValueError, match="base_weight_sharding=2 must equal the world size"):
        OptimizedLinear(4, 2, lora_config=LoRAConfig(base_weight_sharding=2))
    delayed = OptimizedLinear(4, 2, lora_config=LoRAConfig(delay_lora_init=True))
    with pytest.raises(RuntimeError, match="init_lora"):
        delayed(torch.randn(1, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("kwargs, match", [({"lora_r": 0}, "lora_r=0"), ({"base_weight_sharding": 0}, "sharding=0"),
                                           ({"offload_ratio": 2.0}, "offload_ratio=2.0")])
def test_lora_config_checks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(**kwargs)


def test_quantization_config_checks():
    assert QuantizationConfig().fp8_dtype == torch.float8_e4m3fn
    assert QuantizationConfig(mantissa_bits=2).fp8_dtype == torch.float8_e5m2
    with pytest.raises(ValueError, match=r"q_bits=6, mantissa_bits=3.*accepted"):
        QuantizationConfig(q_bits=6)


@pytest.mark.parametrize("mantissa, rel", [(3, 2**-4), (2, 2**-3)])
def test_fp8_group_quantization_error_is_bounded_per_group(mantissa, rel):
    config = QuantizationConfig(mantissa_bits=mantissa, group_size=16)
    values = torch.randn(5, 13) * torch.logspace(-3, 3, 13)  # very different magnitudes across groups
    packed = quantize(values, config)
    assert packed.dtype == torch.uint8 and packed.numel() == 5 * 16 + 4 * 5  # 65 values -> 5 groups + scales
    back = dequantize(packed, config, values.shape, torch.float32)
    groups = torch.nn.functional.pad(values.flatten(), (0, 15)).view(-1, 16)
    bound = groups.abs().amax(1, keepdim=True) * rel  # within half a step of the group's largest value
    err = torch.nn.functional.pad((back - values).flatten(), (0, 15)).view(-1, 16).abs()
    assert (err <= bound).all()
    assert torch.equal(dequantize(quantize(torch.zeros(7), config), config, torch.Size([7]), torch.float32),
                       torch.zeros(7))


def test_quantized_parameter_survives_copy_pickle_and_module_moves():
    torch.manual_seed(0)
    layer = QuantizedLinear(32, 8, quantization_config=QuantizationConfig(group_size=64))
    weight = layer.weight
    assert isinstance(weight, QuantizedParameter) and weight.dtype == torch.uint8 and not weight.requires_grad
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, weight.dequantized()))
    clone = copy.deepcopy(layer)
    assert isinstance(clone.weight, QuantizedParameter) and torch.equal(clone(x), layer(x))
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded.weight.dequantized(), weight.dequantized())
    layer.to("cpu", torch.float32)  # codes are not floats: a dtype move leaves them alone
    assert layer.weight is weight and weight.dtype == torch.uint8
    with pytest.raises(ValueError, match="frozen"):
        QuantizedParameter(torch.randn(3), requires_grad=True)


def test_lora_over_fp8_base():
    torch.manual_seed(0)
    quant = QuantizationConfig(group_size=32)
    layer = OptimizedLinear(16, 8, lora_config=LoRAConfig(lora_r=2), quantization_config=quant)
    assert isinstance(layer.weight, QuantizedParameter) and layer.weight.ds_optim_param
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight.dequantized()))


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4, bias=True)


def test_init_context_swaps_linear_and_restores_it():
    original = torch.nn.Linear
    with pytest.warns(UserWarning, match="init_lora"), deepspeed.linear.Init(lora_config=LoRAConfig(lora_r=2)):
        with pytest.raises(ValueError, match="bias=True"):  # OptimizedLinear layers have no bias
            _Tiny()
        layer = torch.nn.Linear(8, 8)
    assert torch.nn.Linear is original
    assert isinstance(layer, LoRAOptimizedLinear) and not layer._initialized and layer.weight.dtype == torch.bfloat16
    model = torch.nn.Sequential(layer, original(8, 2))
    init_lora(model)
    assert layer._initialized
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"0.lora_weight_1.weight",
                                                                          "0.lora_weight_2.weight"}


def test_checkpoint_outside_target_mods_disables_lora():
    layer = OptimizedLinear(4, 3, lora_config=LoRAConfig(lora_r=2), dtype=torch.float32)
    holder = torch.nn.Module()
    holder.classifier = layer
    state = {"classifier.weight": torch.arange(12.0).view(3, 4)}
    holder.load_state_dict(state)
    assert layer.disabled
    torch.testing.assert_close(layer(torch.eye(4)), state["classifier.weight"].t())


@distributed_test(world_size=[2])
def test_sharded_base_weight_gathers_and_loads_checkpoint_shards():
    rank = dist.get_rank()
    torch.manual_seed(rank)  # ranks initialise their shards independently
    config = LoRAConfig(lora_r=2, base_weight_sharding=2)
    holder = torch.nn.Module()
    holder.q_proj = OptimizedLinear(6, 4, lora_config=config, dtype=torch.float32)
    layer = holder.q_proj
    assert layer.weight.shape == (12,) and layer.weight.ds_optim_param
    full = layer.full_weight()
    shards = [torch.empty(12) for _ in range(2)]
    dist.all_gather(shards, layer.weight.detach())
    assert torch.equal(full, torch.cat(shards).view(4, 6))
    x = torch.randn(3, 6)
    torch.testing.assert_close(layer(x), F.linear(x, full))

    checkpoint = torch.arange(24.0).view(4, 6)  # a full (unsharded) checkpoint weight
    holder.load_state_dict({"q_proj.weight": checkpoint.clone()}, strict=False)
    assert torch.equal(layer.weight, checkpoint.flatten()[rank * 12:(rank + 1) * 12])
    assert torch.equal(layer.full_weight(), checkpoint)
