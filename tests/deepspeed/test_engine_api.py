"""deepspeed.initialize's surface: signature, return tuple, config sources, accessors, optimizers from config,
data loading, the progress log and timers, monitor events, and errors for bad input."""

from __future__ import annotations

import argparse
import csv
import inspect
import logging
import re

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

from ds_config import ConfigError, load_config

IN = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


BASE = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def test_initialize_signature_is_documented():
    import deepspeed

    params = inspect.signature(deepspeed.initialize).parameters
    assert list(params) == ["args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                            "distributed_port", "mpu", "dist_init_required", "collate_fn", "config", "mesh_param",
                            "config_params"]
    assert params["distributed_port"].default == 29500 and all(
        params[n].default is None for n in params if n != "distributed_port")
    engine_sig = inspect.signature(deepspeed.DeepSpeedEngine.backward).parameters
    assert engine_sig["retain_graph"].default is False and engine_sig["scale_wrt_gas"].default is True


def test_add_config_arguments():
    import deepspeed

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"
    assert parser.parse_args([]).deepspeed is False
    old = parser.parse_args(["--deepscale", "--deepscale_config", "x.json"])
    assert old.deepscale and old.deepscale_config == "x.json"


def _api_body(config_path: str) -> dict:
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    args = argparse.Namespace(deepspeed_config=config_path)
    data = torch.utils.data.TensorDataset(torch.randn(40, IN), torch.randn(40, 1))
    engine, optimizer, loader, sched = deepspeed.initialize(args=args, model=_model(), training_data=data)
    boundaries = []
    for i, (x, y) in enumerate(loader):
        if i == 4:
            break
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    engine.set_gradient_accumulation_boundary(True)
    forced = engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(None)
    engine.eval()
    eval_mode = not engine.module.training
    engine.train()
    return {
        "type_exact": type(engine) is DeepSpeedEngine and deepspeed.DeepSpeedEngine is DeepSpeedEngine,
        "optimizer_is_engine_optimizer": optimizer is engine.optimizer, "sched": sched,
        "loader_batch": len(x), "loader_len": len(loader), "boundaries": boundaries, "forced": forced,
        "eval_mode": eval_mode, "training_again": engine.module.training,
        "accessors": [engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                      engine.gradient_accumulation_steps(), engine.zero_optimization_stage(), engine.fp16_enabled(),
                      engine.bf16_enabled(), engine.gradient_clipping(), engine.wall_clock_breakdown(),
                      engine.zero_optimization(), engine.steps_per_print(), engine.postscale_gradients(),
                      str(engine.communication_data_type)],
        "counters": [engine.global_steps, engine.global_samples, engine.micro_steps, engine.skipped_steps],
        "lr": engine.get_lr(), "module_is_submodule": engine.module is dict(engine.named_children())["module"],
        "forwarded": _forwarded(engine),
    }


def _forwarded(engine) -> bool:
    engine.module.custom_flag = 7  # a model attribute reached through the engine, as DeepSpeed allows
    try:
        getattr(engine, "no_such_attribute")  # noqa: B009 - must raise AttributeError
    except AttributeError:
        return engine.custom_flag == 7 and engine.__len__() == 3
    return False


def test_initialize_from_args_with_training_data(tmp_path):
    import json

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(BASE))
    r = run_distributed(_api_body, world_size=2, args=(str(path),), timeout=60)[0]
    assert r["type_exact"] and r["optimizer_is_engine_optimizer"] and r["sched"] is None
    assert r["loader_batch"] == 2 and r["loader_len"] == 10  # 40 samples / 2 ranks / micro batch 2
    assert r["boundaries"] == [False, True, False, True] and r["forced"] is True
    assert r["eval_mode"] and r["training_again"] and r["module_is_submodule"] and r["forwarded"]
    assert r["accessors"] == [8, 2, 2, 0, False, False, 0.0, False, False, 1000, True, "torch.float32"]
    assert r["counters"] == [2, 16, 4, 0]
    assert r["lr"] == [0.1]


def _config_sources_body() -> list[str]:
    import deepspeed

    errors = []
    for kwargs in ({}, {"config": BASE, "config_params": dict(BASE)},
                   {"config": BASE, "args": argparse.Namespace(deepspeed_config="x.json")},
                   {"config": BASE, "model": None},
                   {"config": {**BASE, "optimizer": {"type": "Muon", "params": {"lr": 1e-3, "ns_method": "fast"}}}},
                   {"config": {**BASE, "optimizer": {"type": "NoSuchOpt"}}}):
        kwargs.setdefault("model", _model())
        try:
            deepspeed.initialize(**kwargs)
            errors.append("no error")
        except (ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    engine, _, _, _ = deepspeed.initialize(model=_model(), config_params=BASE)  # the alias alone works
    try:
        engine.backward(torch.ones(3, requires_grad=True))
    except TypeError as exc:
        errors.append(str(exc))
    return errors


def test_bad_inputs_give_clear_errors():
    errors = run_distributed(_config_sources_body, world_size=1, timeout=60)[0]
    assert "no DeepSpeed config" in errors[0]
    assert "config_params" in errors[1]
    assert "args.deepspeed_config" in errors[2]
    assert "model is required" in errors[3]
    assert "optimizer.params.ns_method='fast'" in errors[4] and "'gram', 'standard'" in errors[4]
    assert "optimizer.type" in errors[5] and "NoSuchOpt" in errors[5] and "SGD" in errors[5]
    assert "scalar tensor" in errors[6] and "(3,)" in errors[6]


@pytest.mark.parametrize("section,expected", [
    ({"type": "Adam", "params": {"lr": 1e-3}}, "FusedAdam"),
    ({"type": "adamw", "params": {"lr": 1e-3}}, "FusedAdam"),
    ({"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, "AdamW"),
    ({"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False}}, "Adam"),
    ({"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False}}, "AdamW"),
    ({"type": "Lamb", "params": {"lr": 1e-3}}, "FusedLamb"),
    ({"type": "Lion", "params": {"lr": 1e-4}}, "FusedLion"),
    ({"type": "Adagrad", "params": {"lr": 1e-2}}, "Adagrad"),
    ({"type": "RMSprop", "params": {"lr": 1e-2, "alpha": 0.9}}, "RMSprop"),
    ({"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.5}}, "SGD"),
])
def test_optimizer_from_config(section, expected):
    from deepspeed.runtime.engine._optimizer import optimizer_from_config

    opt = optimizer_from_config(load_config({"optimizer": section}).optimizer, _model().parameters())
    assert type(opt).__name__ == expected
    assert opt.param_groups[0]["lr"] == section["params"]["lr"]
    if expected == "FusedAdam":
        assert opt.param_groups[0].get("adam_w_mode", getattr(opt, "adam_w_mode", True)) is True


def test_optimizer_config_errors_and_zero_rule():
    from deepspeed.runtime.engine._optimizer import check_zero_optimizer, optimizer_from_config

    for name, cls in (("OneBitAdam", "OnebitAdam"), ("ZeroOneAdam", "ZeroOneAdam"), ("OneBitLamb", "OnebitLamb")):
        built = optimizer_from_config(load_config({"optimizer": {"type": name}}).optimizer, _model().parameters())
        assert type(built).__name__ == cls and built.communicates_gradients
    with pytest.raises(ConfigError, match="optimizer.params"):
        optimizer_from_config(load_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "bogus": 1}}})
                              .optimizer, _model().parameters())
    rmsprop = torch.optim.RMSprop(_model().parameters())
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer"):
        check_zero_optimizer(rmsprop, zero_stage=1, allow_untested=False)
    check_zero_optimizer(rmsprop, zero_stage=1, allow_untested=True)
    check_zero_optimizer(rmsprop, zero_stage=0, allow_untested=False)
    check_zero_optimizer(torch.optim.AdamW(_model().parameters()), zero_stage=2, allow_untested=False)


def _monitor_body(out_dir: str) -> dict:
    import deepspeed
    from deepspeed.utils import logger

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(re.sub(r"^\[Rank \d+\] ", "", record.getMessage()))
    logger.addHandler(handler)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2, "wall_clock_breakdown": True,
              "memory_breakdown": True,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8},
              "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "job"}}
    try:
        engine, _, _, _ = deepspeed.initialize(model=_model(), config=config)
        for _ in range(4):
            engine.backward(engine(torch.randn(2, IN)).float().pow(2).mean())
            engine.step()
        engine.destroy()
    finally:
        logger.removeHandler(handler)
    return {"rank": dist.get_rank(), "records": records}


def test_progress_log_and_monitor_events(tmp_path):
    results = run_distributed(_monitor_body, world_size=2, args=(str(tmp_path),), timeout=60)
    rank0 = results[0]["records"]
    assert any(r.startswith("DeepSpeed info: version=") for r in rank0)
    steps = [r for r in rank0 if r.startswith("step=")]
    assert len(steps) == 2 and steps[0].startswith(
        "step=2, skipped=0, lr=[0.1], loss_scale=256, loss(avg of last 2 steps)=")  # the window mean, named so
    assert "samples/sec=" in steps[0]
    timers = [r for r in rank0 if r.startswith("time (ms)")]
    assert len(timers) == 2 and all(p in timers[0] for p in ("forward", "backward_inner", "backward_allreduce"))
    assert len([r for r in rank0 if r.startswith("memory (MiB) | allocated: ")]) == 2
    assert not [r for r in results[1]["records"] if r.startswith("step=")]  # rank 0 only
    job = tmp_path / "job"
    expected = {"Train_Samples_train_loss.csv", "Train_Samples_lr.csv", "Train_Samples_loss_scale.csv",
                *(f"Train_Samples_elapsed_time_ms_{p}.csv" for p in
                  ("forward", "backward", "backward_inner", "backward_allreduce", "step"))}
    assert {p.name for p in job.iterdir()} == expected
    with open(job / "Train_Samples_lr.csv") as f:
        rows = list(csv.reader(f))
    assert rows == [["step", "lr"], ["8", "0.1"], ["16", "0.1"]]  # once per report, step = samples
    with open(job / "Train_Samples_train_loss.csv") as f:
        losses = list(csv.reader(f))[1:]
    assert [r[0] for r in losses] == ["8", "16"] and all(float(r[1]) > 0 for r in losses)


def _steps_inf_body() -> int:
    import deepspeed
    from deepspeed.utils import logger

    count = [0]
    handler = logging.Handler()
    handler.emit = lambda record: count.__setitem__(0, count[0] + ("step=" in record.getMessage()))
    logger.addHandler(handler)
    config = {**BASE, "gradient_accumulation_steps": 1, "train_batch_size": 2, "steps_per_print": float("inf")}
    engine, _, _, _ = deepspeed.initialize(model=_model(), config=config)
    for _ in range(3):
        engine.backward(engine(torch.randn(2, IN)).sum())
        engine.step()
    logger.removeHandler(handler)
    return count[0]


def test_steps_per_print_infinity_never_reports():
    assert run_distributed(_steps_inf_body, world_size=1, timeout=60) == [0]


def _resume_body(save_dir: str, mode: str, precision: str) -> dict:
    import deepspeed

    rank = dist.get_rank()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 15, "warmup_max_lr": 0.01}}}
    if precision != "fp32":
        config[precision] = {"enabled": True, "initial_scale_power": 8}
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, IN, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(20)]
    engine, _, _, _ = deepspeed.initialize(model=_model(), config=config)

    def train(steps):
        for x, y in steps:
            out = engine(x[2 * rank:2 * rank + 2].to(dtype)).float()
            engine.backward(torch.nn.functional.mse_loss(out, y[2 * rank:2 * rank + 2]))
            engine.step()

    if mode == "straight":
        train(batches)
    elif mode == "save":
        train(batches[:10])
        engine.save_checkpoint(save_dir, client_state={"epoch": 3})
        return {}
    else:
        path, client = engine.load_checkpoint(save_dir)
        assert path is not None and client["epoch"] == 3 and engine.global_steps == 10
        train(batches[10:])
    return {"state": {k: v.clone() for k, v in engine.module.state_dict().items()}, "lr": engine.get_lr(),
            "steps": engine.global_steps}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_checkpoint_resume_is_exact(tmp_path, precision):
    straight = run_distributed(_resume_body, world_size=2, args=(str(tmp_path), "straight", precision), timeout=60)
    run_distributed(_resume_body, world_size=2, args=(str(tmp_path), "save", precision), timeout=60)
    resumed = run_distributed(_resume_body, world_size=2, args=(str(tmp_path), "load", precision), timeout=60)
    assert (tmp_path / "latest").read_text().strip() == "global_step10"
    assert resumed[0]["steps"] == 20 and resumed[0]["lr"] == straight[0]["lr"]
    for key, value in straight[0]["state"].items():
        assert torch.equal(resumed[0]["state"][key], value), key  # bitwise on CPU


def _coalesce_body() -> str:
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=_model(), config=BASE)
    try:
        with engine.coalesce_grad_reduction():
            pass
    except NotImplementedError as exc:
        return str(exc)
    return "no error"


def test_coalesce_grad_reduction_is_documented_as_unsupported_at_stage_0():
    assert "ZeRO stage 0" in run_distributed(_coalesce_body, world_size=1, timeout=60)[0]


def _amp_body() -> str:
    import deepspeed

    try:
        deepspeed.initialize(model=_model(), config={**BASE, "amp": {"enabled": True}})
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_apex_amp_is_a_clear_error():
    message = run_distributed(_amp_body, world_size=1, timeout=60)[0]
    assert "amp.enabled" in message and "torch_autocast" in message


class _HalfWorldMPU:
    """A model-parallel unit with two data-parallel groups of 2 (ranks 0,1 and 2,3) and model-parallel size 2."""

    def __init__(self) -> None:
        self.groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]

    def get_data_parallel_group(self):
        return self.groups[dist.get_rank() // 2]

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank() // 2

    def get_model_parallel_world_size(self) -> int:
        return 2


def _mpu_body() -> dict:
    import deepspeed

    config = {**BASE, "train_batch_size": 4, "gradient_accumulation_steps": 1}  # 2 per rank x 2 dp ranks
    engine, _, _, _ = deepspeed.initialize(model=_model(), config=config, mpu=_HalfWorldMPU())
    x = torch.full((2, IN), float(dist.get_rank()))
    engine.backward(engine(x).sum())
    return {"dp": engine.dp_world_size, "mp_rank": engine.mp_rank, "micro": engine.train_micro_batch_size_per_gpu(),
            "grad": engine.module[2].bias.grad.item()}


def test_mpu_supplies_the_data_parallel_group():
    results = run_distributed(_mpu_body, world_size=4, timeout=60)
    assert [r["mp_rank"] for r in results] == [0, 0, 1, 1] and {r["dp"] for r in results} == {2}
    assert {r["micro"] for r in results} == {2}
    assert results[0]["grad"] == results[1]["grad"] == 2.0  # sum over 2 samples, averaged within the group


def _stage_seam_body() -> dict:
    import deepspeed
    from deepspeed.runtime.engine import _stages as _setup

    config = {**BASE, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    original = _setup.STAGE_BUILDERS.pop(2)
    try:
        deepspeed.initialize(model=_model(), config=config)
        missing = "no error"
    except ValueError as exc:
        missing = str(exc)
    built = []

    def builder(inputs):  # a stand-in stage: stage 0's parts, recording that the seam was used
        built.append(inputs.config.zero_stage)
        return _setup.build_stage0(inputs)

    _setup.register_zero_stage(2, builder)
    try:
        engine, _, _, _ = deepspeed.initialize(model=_model(), config=config)
    finally:
        _setup.STAGE_BUILDERS[2] = original
    return {"missing": missing, "built": built, "stage": engine.zero_optimization_stage()}


def test_zero_stage_seam():
    r = run_distributed(_stage_seam_body, world_size=1, timeout=60)[0]
    assert "zero_optimization.stage" in r["missing"] and "accepted: [0, 1, 3]" in r["missing"]
    assert r["built"] == [2] and r["stage"] == 2


def _client_wins_body() -> tuple[str, str, float]:
    import deepspeed
    from deepspeed.utils import logger

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger.addHandler(handler)
    try:
        model = _model()
        client_opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
        config = {**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
        engine, optimizer, _, schedule = deepspeed.initialize(
            model=model, optimizer=client_opt, config=config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    finally:
        logger.removeHandler(handler)
    inner = getattr(optimizer, "optimizer", optimizer)
    return type(inner).__name__, type(schedule).__name__, " | ".join(warnings)


def test_client_optimizer_and_scheduler_win_over_config_sections():
    inner, schedule, warned = run_distributed(_client_wins_body, world_size=1, timeout=60)[0]
    assert inner == "Adagrad"
    assert schedule == "StepLR"
    assert "'optimizer' section (SGD) is ignored" in warned
    assert "'scheduler' section (WarmupLR) is ignored" in warned


def _wrapped_twice_body(stage: int) -> dict:
    """A second engine over the same model object (a second Trainer, ``prepare`` again) must train it exactly as
    an engine over a fresh copy does; the first engine's hooks would otherwise keep reducing its gradients."""
    import copy

    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}
    gen = torch.Generator().manual_seed(dist.get_rank())
    data = [(torch.randn(2, IN, generator=gen), torch.randn(2, 1, generator=gen)) for _ in range(4)]

    def train(engine, batches):
        for x, y in batches:
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()

    model = _model()
    first, _, _, _ = deepspeed.initialize(model=model, config=config)
    train(first, data[:2])
    fresh = copy.deepcopy(model)  # the same weights, no hooks
    second, _, _, _ = deepspeed.initialize(model=model, config=config)
    train(second, data[2:])
    reference, _, _, _ = deepspeed.initialize(model=fresh, config=config)
    train(reference, data[2:])
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    with pytest.raises(RuntimeError) as info:
        first.backward(first(data[0][0]).sum())
    evaluation, _, _, _ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2})
    train(second, data[:1])  # an evaluation engine over the model does not take it from the trainer
    return {"same": same, "error": str(info.value), "second_steps": second.global_steps}


@pytest.mark.parametrize("stage", [0, 2])
def test_wrapping_a_model_again_releases_the_first_engine(stage):
    for result in run_distributed(_wrapped_twice_body, world_size=2, args=(stage,), timeout=60):
        assert result["same"], "the second engine trained differently from one over a fresh copy"
        assert result["error"] == ("engine.backward: this engine can no longer train: its model was wrapped by a "
                                   "newer DeepSpeedEngine")
        assert result["second_steps"] == 3


_TAKE_OVER_CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                     "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}


def _train_steps(engine, seed: int, steps: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(2, IN, generator=gen), torch.randn(2, 1, generator=gen)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def _disjoint_body() -> dict:
    import deepspeed

    config = {**_TAKE_OVER_CONFIG, "zero_optimization": {"stage": 2}}
    model = _model()
    first = deepspeed.initialize(model=model, model_parameters=model[0].parameters(), config=config)[0]
    second = deepspeed.initialize(model=model, model_parameters=model[2].parameters(), config=config)[0]
    before = model[0].weight.detach().clone()
    _train_steps(first, 0)
    _train_steps(second, 1)
    return {"first_moved": not torch.equal(before, model[0].weight.detach())}


def test_engines_over_disjoint_parameters_both_train():
    for result in run_distributed(_disjoint_body, world_size=2, timeout=60):
        assert result["first_moved"]


def _stale_owner_body() -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    model = _model()
    first = deepspeed.initialize(model=model, config={**_TAKE_OVER_CONFIG, "zero_optimization": {"stage": 2}})[0]
    _train_steps(first, 0)
    second = deepspeed.initialize(model=model, config={**_TAKE_OVER_CONFIG, "zero_optimization": {"stage": 0}})[0]
    _train_steps(second, 1, steps=2)
    weight = model[0].weight
    got = safe_get_full_fp32_param(weight)  # stage 0 fp32: None (no master) or the weight itself
    ok = got is None or torch.equal(got, weight.detach())
    del first
    return {"ok": ok}


def test_released_engine_gives_up_parameter_ownership():
    """The safe_* APIs must not read a released engine's stale masters."""
    for result in run_distributed(_stale_owner_body, world_size=2, timeout=60):
        assert result["ok"]
