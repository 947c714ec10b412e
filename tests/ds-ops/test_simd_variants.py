"""The AVX2 and portable builds of the kernels agree with the default (widest) build on every dtype path."""

from __future__ import annotations

import pytest
import torch

from ds_ops import DeepSpeedCPUAdam
from ds_ops._native import NativeKernel
from ds_ops.op_builder import CPUAdamBuilder, supported_simd_levels

CASES = [  # (param dtype, state fp32?, copy dtype)
    (torch.float32, True, torch.bfloat16),
    (torch.float32, True, torch.float16),
    (torch.bfloat16, True, None),
    (torch.bfloat16, False, None),
    (torch.float16, True, None),
]


def _run(kernel, dtype, fp32_states, copy_dtype):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in (5, 33, 1001)]
    opt = DeepSpeedCPUAdam(ps, lr=1e-2, weight_decay=0.1, fp32_optimizer_states=fp32_states)
    opt._kernel = kernel
    copies = [torch.empty(p.numel(), dtype=copy_dtype) for p in ps] if copy_dtype else None
    for _ in range(5):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step(fp16_param_groups=[copies] if copies else None)
    return [p.detach().float() for p in ps] + [c.float() for c in copies or []]


@pytest.mark.parametrize("level", ["avx2", "scalar"])
def test_level_matches_default_build(native, level):
    if level not in supported_simd_levels():
        pytest.skip(f"CPU lacks {level}")
    default = NativeKernel(CPUAdamBuilder().load(), "ds_cpu_adam_step")
    other_builder = CPUAdamBuilder(level)
    other = NativeKernel(other_builder.load(), "ds_cpu_adam_step")
    assert other_builder.load().ds_ops_simd_level().decode() == level
    for dtype, fp32_states, copy_dtype in CASES:
        ours = _run(other, dtype, fp32_states, copy_dtype)
        ref = _run(default, dtype, fp32_states, copy_dtype)
        ulp = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[copy_dtype or dtype]
        for x, y in zip(ours, ref, strict=True):
            assert (x - y).abs().max() <= ulp * y.abs().max(), (level, dtype, fp32_states, copy_dtype)


def _conversion_inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65519.0, 65520.0, 1e6,
                            1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 2**-14, 2**-24, 2**-25, 3 * 2**-26,
                            1e-40, -1e-39, 3.0e38])
    magnitudes = torch.randn(3000, generator=gen) * torch.pow(10.0, torch.randint(-9, 6, (3000,), generator=gen))
    return torch.cat([special, magnitudes])  # 3020 elements: whole vectors and a tail


@pytest.mark.parametrize("level", ["default", "avx2", "scalar"])
def test_low_precision_copy_is_bit_exact_with_torch_casts(native, level):
    if level != "default" and level not in supported_simd_levels():
        pytest.skip(f"CPU lacks {level}")
    builder = CPUAdamBuilder() if level == "default" else CPUAdamBuilder(level)
    values = _conversion_inputs()
    p = torch.nn.Parameter(values.clone())
    p.grad = torch.zeros_like(values)
    opt = DeepSpeedCPUAdam([p], lr=0.0)  # a zero update: the copy converts the original values
    opt._kernel = NativeKernel(builder.load(), "ds_cpu_adam_step")
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(values.numel(), dtype=dtype)
        opt.step(fp16_param_groups=[[out]])
        expected = values.to(dtype)
        nan = expected.isnan()
        assert torch.equal(out.isnan(), nan)
        assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16)), (level, dtype)
