"""DeepSpeedInferenceConfig: dtype names, aliases, deprecated top-level keys, sub-configs, errors with paths."""

from __future__ import annotations

import warnings

import pytest
from _ds_config_testing import config_error

from ds_config._base import DeprecatedConfigWarning, validate_section
from ds_config._errors import ConfigError
from ds_config.inference import (
    DeepSpeedInferenceConfig,
    DeepSpeedMoEConfig,
    DtypeEnum,
    MoETypeEnum,
    QuantizationConfig,
)
from ds_config.zero import DeepSpeedZeroConfig

P = "inference"


def infer(data) -> DeepSpeedInferenceConfig:
    return validate_section(DeepSpeedInferenceConfig, data, path=P)


def error(data) -> ConfigError:
    return config_error(infer, data)


def test_documented_example():
    cfg = infer({"kernel_inject": True, "tensor_parallel": {"tp_size": 4}, "dtype": "fp16",
                 "enable_cuda_graph": False})
    assert cfg.replace_with_kernel_inject is True and cfg.tensor_parallel.tp_size == 4
    assert cfg.dtype is DtypeEnum.fp16 and cfg.dtype.torch_name == "float16"


@pytest.mark.parametrize("spelling,expected", [
    ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"), ("torch.float16", "fp16"), ("torch.half", "fp16"),
    ("FP16", "fp16"), ("fp32", "fp32"), ("float32", "fp32"), ("float", "fp32"), ("torch.float", "fp32"),
    ("bf16", "bf16"), ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"), ("int8", "int8"), ("torch.int8", "int8"),
])
def test_dtype_spellings(spelling, expected):
    assert infer({"dtype": spelling}).dtype is DtypeEnum(expected)


def test_dtype_accepts_torch_dtypes_without_importing_torch_itself():
    torch = pytest.importorskip("torch")
    for dt, expected in ((torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float32, "fp32"),
                         (torch.int8, "int8")):
        parsed = infer({"dtype": dt}).dtype
        assert parsed is DtypeEnum(expected) and getattr(torch, parsed.torch_name) is dt


def test_aliases():
    cfg = infer({"tp": {"tp_size": 2}, "tm": False, "ckpt_config": {"checkpoint_dir": "/ckpt"},
                 "injection_dict": {"Block": ("attn.out", "mlp.out")}, "args": {"hidden": 8},
                 "max_tokens": 2048, "min_tokens": 16})
    assert cfg.tensor_parallel.tp_size == 2 and cfg.triangular_masking is False
    assert cfg.checkpoint_config.checkpoint_dir == "/ckpt"
    assert cfg.injection_policy == {"Block": ("attn.out", "mlp.out")}
    assert cfg.config == {"hidden": 8} and (cfg.max_out_tokens, cfg.min_out_tokens) == (2048, 16)
    assert infer({"min_tokens": 0}).min_out_tokens == 0  # a plain int in DeepSpeed: "no minimum" is valid
    moe = infer({"moe": {"num_experts": [8], "expert_group": "g", "type": "residual"}}).moe
    assert moe.moe_experts == [8] and moe.ep_group == "g" and moe.type is MoETypeEnum.residual


def test_sub_configs_and_opaque_objects():
    group = object()
    cfg = infer({"zero": {"stage": 3, "offload_param": {"device": "cpu"}},
                 "tensor_parallel": {"tp_group": group, "tp_grain_size": 128},
                 "quant": {"weight": {"num_bits": 4, "q_type": "asymmetric"}, "qkv": {"enabled": False}},
                 "checkpoint": {"type": "ds_model", "checkpoints": ["a.pt"]}})
    assert isinstance(cfg.zero, DeepSpeedZeroConfig) and cfg.zero.offload_param_enabled
    assert cfg.tensor_parallel.tp_group is group and cfg.tensor_parallel.tp_grain_size == 128
    assert isinstance(cfg.quant, QuantizationConfig) and cfg.quant.weight.num_bits == 4
    assert cfg.quant.activation.num_bits == 8 and cfg.quant.qkv.enabled is False
    assert cfg.checkpoint["type"] == "ds_model"


@pytest.mark.parametrize("data,attr,expected,new", [
    ({"mp_size": 4}, ("tensor_parallel", "tp_size"), 4, "tensor_parallel.tp_size"),
    ({"ep_size": 2}, ("moe", "ep_size"), 2, "moe.ep_size"),
    ({"moe_experts": [4, 4]}, ("moe", "moe_experts"), [4, 4], "moe.moe_experts"),
    ({"moe_type": "residual"}, ("moe", "type"), MoETypeEnum.residual, "moe.type"),
    ({"expert_group": "eg"}, ("moe", "ep_group"), "eg", "moe.ep_group"),
    ({"ep_mp_group": "emp"}, ("moe", "ep_mp_group"), "emp", "moe.ep_mp_group"),
    ({"mpu": "unit"}, ("tensor_parallel", "mpu"), "unit", "tensor_parallel.mpu"),
])
def test_deprecated_keys_move_into_sub_configs(data, attr, expected, new):
    with pytest.warns(DeprecatedConfigWarning, match=new.replace(".", r"\.")):
        cfg = infer(data)
    assert getattr(getattr(cfg, attr[0]), attr[1]) == expected


def test_deprecated_mp_size_keeps_other_tensor_parallel_keys():
    with pytest.warns(DeprecatedConfigWarning):
        cfg = infer({"mp_size": 2, "tensor_parallel": {"tp_grain_size": 32}})
    assert (cfg.tensor_parallel.tp_size, cfg.tensor_parallel.tp_grain_size) == (2, 32)


def test_moe_boolean_and_deprecated_moe_keys_combine():
    with pytest.warns(DeprecatedConfigWarning):
        cfg = infer({"moe": False, "ep_size": 2})
    assert isinstance(cfg.moe, DeepSpeedMoEConfig) and cfg.moe.enabled is False and cfg.moe.ep_size == 2
    assert infer({"moe": True}).moe.enabled is True


def test_deprecated_default_values_are_ignored_and_dumps_round_trip():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = infer({"mp_size": 1, "tensor_parallel": {"tp_size": 4}})
        assert cfg.tensor_parallel.tp_size == 4
        dumped = cfg.model_dump(mode="json")
        assert "mp_size" not in dumped and infer(dumped).model_dump(mode="json") == dumped


def test_assignment_converts_dtype():
    cfg = infer({})
    cfg.dtype = "bfloat16"
    assert cfg.dtype is DtypeEnum.bf16


@pytest.mark.parametrize("data,path,words", [
    ({"dtype": "fp8"}, "dtype", "accepted: "),
    ({"dtype": 16}, "dtype", "accepted: "),
    ({"mp_size": 2, "tp": {"tp_size": 2}}, "", "give only 'tp.tp_size'"),
    ({"mp_size": 2, "tensor_parallel": {"tp_size": 2}}, "", "give only 'tensor_parallel.tp_size'"),
    ({"tensor_parallel": {"tp_size": 0}}, "tensor_parallel.tp_size", "greater than or equal to 1"),
    ({"tp": {"tp_sise": 2}}, "tp.tp_sise", "did you mean 'tp_size'"),
    ({"min_tokens": 4096}, "min_tokens", "max_out_tokens"),
    ({"max_out_tokens": 0}, "max_out_tokens", "greater than or equal to 1"),
    ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ({"max_tokens": 8, "max_out_tokens": 8}, "max_tokens", "given twice, as 'max_out_tokens' and 'max_tokens'"),
    ({"moe": {"num_experts": [2], "moe_experts": [2]}}, "moe.num_experts", "'moe_experts' and 'num_experts'"),
    ({"training_mp_size": 2.5}, "training_mp_size", "fractional"),
    ({"moe": {"num_experts": [0]}}, "moe.num_experts[0]", "greater than or equal to 1"),
    ({"moe": {"type": "dense"}}, "moe.type", "'residual' or 'standard'"),
    ({"quant": {"activation": {"q_type": "sym"}}}, "quant.activation.q_type", "'symmetric' or 'asymmetric'"),
    ({"zero": {"stage": 2, "offload_param": {"device": "cpu"}}}, "zero.offload_param.device", "stage 3"),
    ({"kernel_inject": "yes"}, "kernel_inject", "boolean"),
    ({"replace_with_kernel_injection": True}, "replace_with_kernel_injection", "did you mean"),
])
def test_errors_name_the_full_key_path(data, path, words):
    err = error(data)
    full = f"{P}.{path}" if path else P
    assert full in err.paths, err
    assert words in str(err)


def test_auto_means_default():
    cfg = infer({"dtype": "auto", "replace_method": "auto", "tensor_parallel": {"tp_size": "auto"}})
    assert cfg.dtype is DtypeEnum.fp16 and cfg.replace_method == "auto" and cfg.tensor_parallel.tp_size == 1


def test_replace_method_is_deprecated_but_auto_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert infer({"replace_method": "auto"}).replace_method == "auto"
    with pytest.warns(DeprecatedConfigWarning, match="'replace_method' is deprecated.*no longer needed"):
        assert infer({"replace_method": "layer"}).replace_method == "layer"
