"""ZeRO 1/2 with CPU offload: ``accumulated_grads_in_cpu`` (DeepSpeed's name) lists the per-parameter gradient
accumulators held in CPU memory between micro-steps. One backward per step holds none; stage 1 with fp32
accumulation of bf16 gradients holds one per parameter until the step; stage 2 accumulates in its gradient
partition and holds none. Without offload the attribute does not exist, as in DeepSpeed."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed


def _body(stage: int, offload: bool, fp32_accum: bool, gas: int) -> dict:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
              "zero_optimization": zero, "bf16": {"enabled": True}, "zero_force_ds_cpu_optimizer": False,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    if fp32_accum:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    if not hasattr(engine.optimizer, "accumulated_grads_in_cpu"):
        return {"exists": False}
    seen = []
    x = torch.randn(gas, 4, dtype=torch.bfloat16)
    for i in range(gas):
        loss = engine(x[i:i + 1]).float().pow(2).sum()
        engine.backward(loss)
        held = engine.optimizer.accumulated_grads_in_cpu
        seen.append((len(held), all(t.dtype == torch.float32 and t.device.type == "cpu" for t in held.values())))
        engine.step()
    return {"exists": True, "during": seen, "after": len(engine.optimizer.accumulated_grads_in_cpu),
            "params": len(list(model.parameters()))}


@pytest.mark.parametrize("stage", [1, 2])
def test_single_backward_holds_no_cpu_accumulator(stage):
    (r,) = run_distributed(_body, world_size=1, args=(stage, True, False, 1), timeout=120)
    assert r["exists"] and r["during"] == [(0, True)] and r["after"] == 0


def test_stage1_fp32_accumulation_holds_one_per_parameter_until_the_step():
    (r,) = run_distributed(_body, world_size=1, args=(1, True, True, 2), timeout=120)
    assert r["during"] == [(r["params"], True), (r["params"], True)]
    assert r["after"] == 0


def test_without_offload_the_attribute_is_absent():
    (r,) = run_distributed(_body, world_size=1, args=(2, False, False, 1), timeout=120)
    assert r == {"exists": False}
