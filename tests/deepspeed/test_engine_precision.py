"""fp16 loss scaling (overflow skip agreed across ranks, scale moves), direct loss.backward() rules, bf16 with
fp32 master weights and fp32 gradient accumulation, torch_autocast."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

# the shared model, data and reference live in test_engine.py (pytest's importlib mode has no package here)
_spec = importlib.util.spec_from_file_location("_ds_test_engine_common", Path(__file__).with_name("test_engine.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)
IN, SGD, make_model = common.IN, common.SGD, common.make_model
assert_close_states, reference_run, global_batches = common.assert_close_states, common.reference_run, \
    common.global_batches


def _fp16_overflow_body() -> dict:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "steps_per_print": 1000,
              "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1,
                       "min_loss_scale": 1}}
    engine, optimizer, _, _ = deepspeed.initialize(model=make_model(0), config=config)
    weight = engine.module[0].weight
    x = torch.randn(2, IN).half()
    scales, skipped, changed = [], [], []
    for step in range(5):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        if step == 1 and dist.get_rank() == 0:  # only rank 0 overflows: every rank must skip
            weight.grad[0, 0] = math.inf
        before = weight.detach().clone()
        engine.step()
        assert engine.was_step_applied() == (step != 1)
        scales.append(optimizer.loss_scale)
        skipped.append(engine.skipped_steps)
        changed.append(not torch.equal(before, weight.detach()))
    return {"scales": scales, "skipped": skipped, "changed": changed, "dtype": str(weight.dtype),
            "master_dtype": str(optimizer.optimizer.param_groups[0]["params"][0].dtype)}


def test_fp16_overflow_skips_step_on_every_rank_and_moves_the_scale():
    for r in run_distributed(_fp16_overflow_body, world_size=2, timeout=60):
        assert r["dtype"] == "torch.float16" and r["master_dtype"] == "torch.float32"
        assert r["skipped"] == [0, 1, 1, 1, 1]
        assert r["changed"] == [True, False, True, True, True]
        # 256; the overflow at iteration 1 halves it (hysteresis 1); doubled once 2 clean iterations follow the
        # first one after the overflow (DeepSpeed 0.19's count)
        assert r["scales"] == [256.0, 128.0, 128.0, 128.0, 256.0]


def test_dynamic_loss_scaler_hysteresis_and_window():
    from deepspeed.runtime.precision.loss_scalers import DynamicLossScaler

    s = DynamicLossScaler(init_scale=1024, scale_window=3, min_scale=1, delayed_shift=2)
    s.update_scale(True)
    assert s.loss_scale == 1024  # first overflow only uses up hysteresis
    s.update_scale(True)
    assert s.loss_scale == 512
    for _ in range(3):
        s.update_scale(False)
    assert s.loss_scale == 512  # DeepSpeed counts the window from the step after the first clean one
    s.update_scale(False)
    assert s.loss_scale == 1024
    floor = DynamicLossScaler(init_scale=2, min_scale=2)
    with pytest.raises(RuntimeError, match="min_loss_scale"):
        floor.update_scale(True)


def _direct_backward_body() -> dict:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "steps_per_print": 1000,
              "fp16": {"enabled": True, "loss_scale": 64}}
    engine, _, _, _ = deepspeed.initialize(model=make_model(0), config=config)
    x = torch.randn(2, IN).half()
    error = ""
    try:
        engine(x).float().pow(2).mean().backward()
    except RuntimeError as exc:
        error = str(exc)
    engine.zero_grad()
    engine.scale(engine(x).float().pow(2).mean()).backward()
    manual = engine.module[0].weight.grad.clone()
    engine.zero_grad()
    engine.backward(engine(x).float().pow(2).mean())
    automatic = engine.module[0].weight.grad.clone()
    return {"error": error, "same": torch.equal(manual, automatic), "scaled": float(manual.abs().max())}


def test_direct_backward_needs_scale_with_fp16():
    r = run_distributed(_direct_backward_body, world_size=2, timeout=60)[0]
    assert "unscaled loss" in r["error"] and "engine.scale" in r["error"]
    assert r["same"] and r["scaled"] > 0


def _direct_backward_fp32_body() -> bool:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "steps_per_print": 1000}
    engine, _, _, _ = deepspeed.initialize(model=make_model(0), config=config)
    x = torch.randn(2, IN) + dist.get_rank()
    engine(x).pow(2).mean().backward()  # hooks reduce as in engine.backward
    g = engine.module[0].weight.grad.clone()
    others = [torch.empty_like(g) for _ in range(2)]
    dist.all_gather(others, g)
    return torch.equal(others[0], others[1])


def test_direct_backward_reduces_gradients_in_fp32():
    assert run_distributed(_direct_backward_fp32_body, world_size=2, timeout=60) == [True, True]


def test_bf16_trains_close_to_fp32_reference():
    steps = 10
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "optimizer": SGD,
              "steps_per_print": 1000, "bf16": {"enabled": True}}
    got = run_distributed(_bf16_run, world_size=2, args=(config, steps), timeout=60)[0]
    ref = reference_run(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), steps, 8)
    assert got["dtypes"] == {"torch.bfloat16"} and got["master"] == "torch.float32"
    assert_close_states({k: v.float() for k, v in got["state"].items()}, ref["state"], rtol=3e-2)


def test_bf16_with_fp32_gradient_accumulation():
    steps = 10
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "optimizer": SGD,
            "steps_per_print": 1000, "bf16": {"enabled": True}}
    fp32acc = {**base, "data_types": {"grad_accum_dtype": "fp32"}}
    got = run_distributed(_bf16_run, world_size=2, args=(fp32acc, steps), timeout=60)[0]
    assert got["grad_dtype"] == "torch.float32"
    ref = reference_run(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), steps, 8)
    assert_close_states({k: v.float() for k, v in got["state"].items()}, ref["state"], rtol=3e-2)


def _bf16_run(config: dict, steps: int) -> dict:
    import deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, optimizer, _, _ = deepspeed.initialize(model=make_model(0), config=config)
    gas, micro = config["gradient_accumulation_steps"], config["train_micro_batch_size_per_gpu"]
    grad_dtype = None
    for x, y in global_batches(steps, micro * gas * world):
        for g in range(gas):
            lo = (g * world + rank) * micro
            out = engine(x[lo:lo + micro].bfloat16()).float()
            engine.backward(torch.nn.functional.mse_loss(out, y[lo:lo + micro]))
            p = engine.module[0].weight
            grad = optimizer.get_grad(p)
            grad_dtype = str(grad.dtype) if grad is not None else grad_dtype
            engine.step()
    return {"state": {k: v.clone() for k, v in engine.module.state_dict().items()},
            "dtypes": {str(p.dtype) for p in engine.module.parameters()},
            "master": str(optimizer.optimizer.param_groups[0]["params"][0].dtype), "grad_dtype": grad_dtype}


def _autocast_body() -> dict:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "steps_per_print": 1000,
              "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    engine, optimizer, _, _ = deepspeed.initialize(model=make_model(0), config=config)
    from deepspeed.runtime.torch_autocast import is_autocast_initialized

    out = engine(torch.randn(2, IN))
    with torch.autocast("cpu", dtype=torch.float16):  # the config's dtype overrides an outer autocast
        nested = engine(torch.randn(2, IN))
    engine.backward(out.float().pow(2).mean())
    engine.step()
    safe = engine.reducer.options.autocast_dtype_of
    return {"out": str(out.dtype), "nested": str(nested.dtype), "params": str(engine.module[0].weight.dtype),
            "initialized": is_autocast_initialized(), "safe": sorted(str(d) for d in safe.values()),
            "n_safe": len(safe), "scale": optimizer.loss_scale}


def test_torch_autocast():
    r = run_distributed(_autocast_body, world_size=2, timeout=60)[0]
    assert r["out"] == r["nested"] == "torch.bfloat16"
    assert r["params"] == "torch.float32" and r["initialized"]
    assert r["n_safe"] == 4 and r["safe"] == ["torch.bfloat16"] * 4  # both Linear layers' weight and bias
    assert r["scale"] == 1.0  # bf16 needs no loss scaling


def test_fp16_engine_training_close_to_reference():
    steps = 10
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "steps_per_print": 1000,
              "fp16": {"enabled": True, "initial_scale_power": 10, "auto_cast": True}}
    got = run_distributed(_fp16_cast_run, world_size=2, args=(config, steps), timeout=60)[0]
    ref = reference_run(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), steps, 4)
    assert_close_states({k: v.float() for k, v in got.items()}, ref["state"], rtol=1e-2)


def _fp16_cast_run(config: dict, steps: int) -> dict:
    import deepspeed

    rank = dist.get_rank()
    engine, _, _, _ = deepspeed.initialize(model=make_model(0), config=config)
    for x, y in global_batches(steps, 4):
        out = engine(x[2 * rank:2 * rank + 2]).float()  # auto_cast turns the fp32 input into fp16
        engine.backward(torch.nn.functional.mse_loss(out, y[2 * rank:2 * rank + 2]))
        engine.step()
    return {k: v.clone() for k, v in engine.module.state_dict().items()}


def _flops_profiler_body() -> dict:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "steps_per_print": 2,
              "flops_profiler": {"enabled": True, "profile_step": 2, "detailed": False}}
    engine, _, _, _ = deepspeed.initialize(model=make_model(0), config=config)
    for _ in range(3):
        engine.backward(engine(torch.randn(2, IN)).pow(2).mean())
        engine.step()
    return {"flops": engine.flops_profiler.flops, "started": engine.flops_profiler.started,
            "timers_on": engine.timers.enabled}


def test_flops_profiler_profiles_the_configured_step():
    r = run_distributed(_flops_profiler_body, world_size=1, timeout=60)[0]
    assert r["flops"] > 0 and not r["started"] and r["timers_on"]


def _cuda_body(precision: str) -> dict:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "steps_per_print": 1000, precision: {"enabled": True}}
    if precision == "fp16":
        config[precision]["initial_scale_power"] = 12
    engine, optimizer, _, _ = deepspeed.initialize(model=make_model(0), config=config)
    x, y = torch.randn(4, IN, device="cuda"), torch.randn(4, 3, device="cuda")
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"device": str(next(engine.module.parameters()).device), "first": losses[0], "last": losses[-1]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_mixed_precision_trains(precision):
    r = run_distributed(_cuda_body, world_size=1, args=(precision,), backend="nccl", timeout=120)[0]
    assert r["device"].startswith("cuda") and r["last"] < r["first"]


def _autocast_fp16_body() -> dict:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "steps_per_print": 1000,
              "torch_autocast": {"enabled": True, "dtype": "float16"}}
    engine, optimizer, _, _ = deepspeed.initialize(model=make_model(0), config=config)
    x = torch.randn(2, IN)
    error = ""
    try:
        engine(x).float().pow(2).mean().backward()
    except RuntimeError as exc:
        error = str(exc)
    engine.zero_grad()
    loss = engine(x).float().pow(2).mean()
    engine.scale(loss).backward()  # the documented manual path
    before = engine.module[0].weight.detach().clone()
    engine.step()
    return {"error": error, "scale": optimizer.loss_scale, "moved": not torch.equal(before, engine.module[0].weight),
            "out": str(engine(x).dtype)}


def test_torch_autocast_fp16_uses_a_grad_scaler():
    r = run_distributed(_autocast_fp16_body, world_size=2, timeout=60)[0]
    assert r["out"] == "torch.float16" and r["scale"] == 2.0 ** 16 and r["moved"]
    assert "unscaled loss" in r["error"]


def _load_module_only_body(save_dir: str) -> dict:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "steps_per_print": 1000,
              "bf16": {"enabled": True}}
    x = torch.randn(2, IN).bfloat16()
    trained, _, _, _ = deepspeed.initialize(model=make_model(0), config=config)
    for _ in range(3):
        trained.backward(trained(x).float().pow(2).mean())
        trained.step()
    trained.save_checkpoint(save_dir)
    fresh, optimizer, _, _ = deepspeed.initialize(model=make_model(1), config=config)
    fresh.load_checkpoint(save_dir, load_module_only=True)
    master = optimizer.master_of[fresh.module[0].weight]
    return {"synced": torch.equal(master.detach().bfloat16(), trained.module[0].weight.detach())}


def test_load_module_only_refreshes_fp32_master_weights(tmp_path):
    assert run_distributed(_load_module_only_body, world_size=2, args=(str(tmp_path),), timeout=60)[0]["synced"]


def _outer_autocast_disabled_body() -> str:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, "steps_per_print": 1000}
    engine, _, _, _ = deepspeed.initialize(model=make_model(0), config=config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return str(engine(torch.randn(2, IN)).dtype)


def test_outer_autocast_is_disabled_inside_engine_without_torch_autocast():
    assert run_distributed(_outer_autocast_disabled_body, world_size=1, timeout=60) == ["torch.float32"]
