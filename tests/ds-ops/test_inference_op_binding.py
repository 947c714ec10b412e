"""The inference kernels' config (``deepspeed.ops.transformer.DeepSpeedInferenceConfig``) and elementwise ops
(``deepspeed.ops.transformer.inference.op_binding``): DeepSpeed's defaults and arguments, and each op against its
formula in fp32 and fp16 (fp32 arithmetic, one rounding)."""

import json

import pytest
import torch

from ds_ops.transformer import DeepSpeedInferenceConfig
from ds_ops.transformer.inference import ActivationFuncType, NormType
from ds_ops.transformer.inference.op_binding import BiasAddOp, BiasGeluOp, BiasReluOp, ResidualAddOp, VectorAddOp


def test_config_defaults_and_arguments(tmp_path):
    config = DeepSpeedInferenceConfig(hidden_size=64, heads=4, dtype=torch.float32, layer_norm_eps=1e-5, mp_size=2)
    assert (config.intermediate_size, config.epsilon, config.mp_size, config.dtype) == (256, 1e-5, 2, torch.float32)
    assert config.layer_id == -1 and config.pre_layer_norm and config.mlp_after_attn
    assert config.norm_type is NormType.LayerNorm and config.mlp_act_func_type is ActivationFuncType.GELU
    assert DeepSpeedInferenceConfig().dtype is torch.float16  # DeepSpeed's default: fp16 kernels
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['hiden_size'\]"):
        DeepSpeedInferenceConfig(hiden_size=3)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"hidden_size": 32, "mp_size": 4}))
    loaded = DeepSpeedInferenceConfig.from_json_file(str(path))
    assert (loaded.hidden_size, loaded.mp_size, loaded.rope_theta) == (32, 4, 10000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bias_ops_match_their_formula(dtype):
    torch.manual_seed(0)
    x, b = torch.randn(2, 5, 16, dtype=dtype), torch.randn(16, dtype=dtype)
    config = DeepSpeedInferenceConfig(dtype=dtype)
    exact = x.float() + b.float()
    assert torch.equal(BiasAddOp(config)(x, b), x + b)
    assert torch.equal(BiasReluOp(config)(x, b), exact.clamp_min(0).to(dtype))
    tanh_gelu = 0.5 * exact * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (exact + 0.044715 * exact ** 3)))
    torch.testing.assert_close(BiasGeluOp(config)(x, b), tanh_gelu.to(dtype), atol=1e-6, rtol=1e-6)
    assert torch.equal(VectorAddOp(config)(x, x, 0.5), (0.5 * x.float() + x.float()).to(dtype))


@pytest.mark.parametrize("mlp_after_attn,pre_ln,add_bias", [(True, True, True), (True, False, True),
                                                             (False, True, True), (False, True, False)])
def test_residual_add_forms(mlp_after_attn, pre_ln, add_bias):
    torch.manual_seed(1)
    hidden, residual, attn = (torch.randn(2, 3, 8) for _ in range(3))
    attn_bias, final_bias = torch.randn(8), torch.randn(8)
    mp = 2
    if mlp_after_attn:
        expected = (hidden + (residual + attn + attn_bias + final_bias) / mp if pre_ln
                    else residual + hidden + final_bias)
    else:
        expected = hidden + attn + (residual + final_bias) / mp + (attn_bias / mp if add_bias else 0)
    config = DeepSpeedInferenceConfig(dtype=torch.float32, mp_size=mp, mlp_after_attn=mlp_after_attn,
                                      pre_layer_norm=pre_ln)
    res = residual.clone()
    out = ResidualAddOp(config)(hidden.clone(), res, add_bias, attn, None, attn_bias, final_bias)
    assert out is res  # written into the residual buffer
    torch.testing.assert_close(out, expected)
    no_bias = ResidualAddOp(config)(hidden, residual, False, attn)
    torch.testing.assert_close(no_bias, (residual + attn) / mp + hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_gate_and_moe_mix_ops(dtype):
    from ds_ops.transformer.inference.op_binding import (
        GatedActivationOp,
        LayerNormOp,
        MoEResMatmulOp,
        PreRMSNormOp,
        RMSNormOp,
    )

    torch.manual_seed(2)
    x, res = torch.randn(2, 3, 8, dtype=dtype), torch.randn(2, 3, 8, dtype=dtype)
    gamma, beta, bias = torch.rand(8, dtype=dtype) + 0.5, torch.randn(8, dtype=dtype), torch.randn(8, dtype=dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
    ln = torch.nn.functional.layer_norm(x.float(), (8,), gamma.float(), beta.float(), 1e-5)
    torch.testing.assert_close(LayerNormOp()(x, gamma, beta, 1e-5), ln.to(dtype), **tol)
    summed = x.float() + bias.float() + res.float()
    normed, pre = LayerNormOp.layer_norm_residual_store_pre_ln_res(x, bias, res, gamma, beta, 1e-5)
    torch.testing.assert_close(pre, summed.to(dtype), **tol)
    torch.testing.assert_close(normed, LayerNormOp.layer_norm_residual(x, bias, res, gamma, beta, 1e-5))
    rms = gamma.float() * x.float() / (x.float().square().mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(RMSNormOp()(x, gamma, 1e-6).float(), rms, **tol)
    out, new_res = PreRMSNormOp()(x, res, gamma, 1e-6)
    torch.testing.assert_close(new_res, (x.float() + res.float()).to(dtype), **tol)
    torch.testing.assert_close(out, RMSNormOp()(x.float() + res.float(), gamma, 1e-6), **tol)
    gated = GatedActivationOp()(torch.cat([x, res], -1), torch.cat([bias, bias]), ActivationFuncType.GATED_SILU)
    expected = (x + bias) * torch.nn.functional.silu((res + bias).float()).to(dtype)
    torch.testing.assert_close(gated, expected, **tol)
    with pytest.raises(ValueError, match="not a gated activation"):
        GatedActivationOp()(x, bias, ActivationFuncType.GELU)
    to_res, to_out = torch.randn(1, 1, 8, dtype=dtype), torch.randn(1, 1, 8, dtype=dtype)
    coef = torch.cat([to_res, to_out], dim=-1).transpose(-1, -2)  # [1, 16, 1], the kernel's layout
    torch.testing.assert_close(MoEResMatmulOp()(res, coef, x), res * to_res + x * to_out, **tol)
