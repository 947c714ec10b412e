"""A direct ``loss.backward()`` on an engine output averages over the gradient accumulation window exactly as
``engine.backward(loss)`` does (DeepSpeed divides the gradient reaching each output by
``gradient_accumulation_steps``), at every ZeRO stage; ``torch.func`` transforms of the engine are not scaled."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

GAS = 4


def _window_grads(stage: int, how: str) -> list[torch.Tensor]:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
              "zero_optimization": zero, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(GAS):
        x = torch.randn(4, 4, generator=gen)[2 * rank:2 * rank + 2]
        loss = engine(x).pow(2).mean()
        if how == "engine":
            engine.backward(loss)
        elif how == "scale":
            engine.scale(loss).backward()
        else:
            loss.backward()
        if engine.is_gradient_accumulation_boundary():
            grads = [safe_get_full_grad(p).clone() for p in engine.module.parameters()]
        engine.step()
    engine.destroy()
    return grads


def _reference() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    gen = torch.Generator().manual_seed(1)
    for _ in range(GAS):
        x = torch.randn(4, 4, generator=gen)
        for rank in range(2):  # the mean over ranks and over the window
            (model(x[2 * rank:2 * rank + 2]).pow(2).mean() / (2 * GAS)).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_direct_backward_averages_over_the_window(stage):
    want = _reference()
    for how in ("direct", "scale", "engine"):
        got = run_distributed(_window_grads, world_size=2, args=(stage, how), timeout=90)
        for rank_grads in got:
            for have, expect in zip(rank_grads, want, strict=True):
                torch.testing.assert_close(have, expect, rtol=1e-5, atol=1e-6, msg=f"{how}, stage {stage}")


def _func_grad() -> tuple[torch.Tensor, torch.Tensor]:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    baseline = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    baseline.load_state_dict(model.state_dict())
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    x = torch.randn(4)
    got = torch.func.grad(lambda v: engine(v).sum())(x)
    want = torch.func.grad(lambda v: baseline(v).sum())(x)
    engine.destroy()
    return got, want


def test_torch_func_grad_through_the_engine_is_not_scaled():
    got, want = run_distributed(_func_grad, world_size=1, timeout=60)[0]
    torch.testing.assert_close(got, want)


def _scale_non_scalar() -> list[str]:
    import deepspeed

    model = torch.nn.Linear(4, 3)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    out = engine(torch.randn(2, 4))
    errors = []
    for bad in (out, out.detach().sum(), 1.0):
        with pytest.raises(AssertionError, match="scalar tensor") as info:  # as DeepSpeed; also a TypeError
            engine.scale(bad)
        assert isinstance(info.value, TypeError)
        errors.append(str(info.value))
    engine.destroy()
    return errors


def test_scale_rejects_what_is_not_a_scalar_loss():
    errors = run_distributed(_scale_non_scalar, world_size=1, timeout=60)[0]
    assert "Tensor(2, 3)" in errors[0] and "Tensor()" in errors[1] and "float" in errors[2]


def _needs_scaler(precision: str) -> bool:
    import deepspeed

    model = torch.nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    needs = engine.optimizer.needs_scaler()
    engine.destroy()
    return needs


@pytest.mark.parametrize(("precision", "needs"), [("fp16", True), ("bf16", False), ("fp32", False)])
def test_needs_scaler_only_with_fp16(precision, needs):
    assert run_distributed(_needs_scaler, world_size=1, args=(precision,), timeout=60) == [needs]
