"""DeepSpeed's stage-0 mixed-precision optimizer classes (FP16_Optimizer, FP16_UnfusedOptimizer, BF16_Optimizer):
built standalone from DeepSpeed's arguments, and the classes the engine builds at ZeRO stage 0."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed

from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer


def _model(dtype: torch.dtype) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).to(dtype)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(8, 4), torch.randn(8, 3)


def _reference_step(lr: float, micro_steps: int = 1) -> list[torch.Tensor]:
    """fp32 SGD on the bf16-rounded weights: what the fp32 masters must hold after one step."""
    model = _model(torch.bfloat16).float()
    x, y = _data()
    for _ in range(micro_steps):
        torch.nn.functional.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return [p.detach() for p in model.parameters()]


def test_unfused_static_scale_step_matches_fp32_reference() -> None:
    model = _model(torch.bfloat16)
    opt = FP16_UnfusedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), low_precision_dtype=torch.bfloat16)
    assert opt.loss_scale_config.cur_scale == 1 and opt.loss_scale_config.dynamic_loss_scale is False
    x, y = _data()
    opt.backward(torch.nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16()))
    assert opt.step() is True
    for master, ref in zip(opt.fp32_groups[0], _reference_step(0.1), strict=True):
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, ref, atol=2e-2, rtol=0)
    assert all(p.dtype == torch.bfloat16 for p in opt.fp16_groups[0])


def test_fused_dynamic_scale_skips_overflow_and_halves() -> None:
    model = _model(torch.float16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 1024.0, "scale_window": 10, "min_scale": 1.0,
                                            "delayed_shift": 1})
    assert opt.cur_scale == 1024.0 and opt.dynamic_loss_scale
    before = [t.clone() for t in opt.fp32_groups_flat]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("inf"))
    assert opt.step() is False and opt.overflow
    assert opt.cur_scale == 512.0
    for a, b in zip(before, opt.fp32_groups_flat, strict=True):
        assert torch.equal(a, b)


def test_bf16_optimizer_accumulates_micro_steps_in_fp32() -> None:
    model = _model(torch.bfloat16)
    opt = BF16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), {}, grad_acc_dtype=torch.float32)
    x, y = _data()
    for _ in range(2):  # two micro-steps: folded into the fp32 buffers before step
        opt.backward(torch.nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16()))
        for p in model.parameters():
            opt.on_grad(p)
    opt.step()
    for master, ref in zip(opt.fp32_groups[0], _reference_step(0.1, micro_steps=2), strict=True):
        torch.testing.assert_close(master, ref, atol=3e-2, rtol=0)


def test_bad_arguments_are_named() -> None:
    model = _model(torch.bfloat16)
    with pytest.raises(ValueError, match="grad_acc_dtype"):
        BF16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), {}, grad_acc_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="low_precision_dtype"):
        FP16_UnfusedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), low_precision_dtype=torch.float32)
    with pytest.raises(ValueError, match="closure"):
        FP16_UnfusedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              low_precision_dtype=torch.bfloat16).step(closure=lambda: 0.0)


def _engine_body(grad_accum: str | None) -> tuple[str, float, list[torch.Tensor]]:
    import deepspeed

    model = _model(torch.float32)
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}
    if grad_accum:
        config["data_types"] = {"grad_accum_dtype": grad_accum}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data()
    engine.backward(torch.nn.functional.mse_loss(engine(x.bfloat16()), y.bfloat16()))
    engine.step()
    opt = engine.optimizer
    return type(opt).__name__, opt.loss_scale_config.cur_scale, [m.detach().clone() for m in opt.fp32_groups[0]]


@pytest.mark.parametrize(("grad_accum", "expected"), [(None, FP16_UnfusedOptimizer), ("fp32", BF16_Optimizer)])
def test_engine_builds_deepspeeds_class_at_stage0(grad_accum: str | None, expected: type) -> None:
    name, scale, masters = run_distributed(_engine_body, world_size=1, args=(grad_accum,), timeout=120)[0]
    assert name == expected.__name__ and scale == 1
    for master, ref in zip(masters, _reference_step(0.1), strict=True):
        torch.testing.assert_close(master, ref, atol=2e-2, rtol=0)
