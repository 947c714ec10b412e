"""Engine and accelerator calls that client frameworks make (a survey of Megatron-DeepSpeed, TRL, Accelerate and
DeepSpeed-Chat): batch-size ramp-up, the data post-processing hook, the consolidated 16-bit state dict, the
accelerator's op builders, and TRL's dotted config keys."""

from __future__ import annotations

import warnings

import pytest
import torch
from _harness import run_distributed

from ds_config import ConfigError, load_config
from ds_config.unbuilt import InertConfigKeyWarning


def _engine(config: dict):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    base = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={**base, **config})
    return engine


def _boundaries(engine, micro_steps: int) -> list[bool]:
    seen = []
    for _ in range(micro_steps):
        seen.append(engine.is_gradient_accumulation_boundary())
        loss = engine(torch.randn(2, 4)).sum()
        engine.backward(loss)
        engine.step()
    return seen


def _ramp_up_body() -> dict:
    engine = _engine({"gradient_accumulation_steps": 2})
    first = _boundaries(engine, 2)  # one optimizer step at GAS 2
    engine.set_train_batch_size(8)  # micro 2 x 1 rank -> GAS 4
    out = {"first": first, "gas": engine.gradient_accumulation_steps(), "batch": engine.train_batch_size(),
           "dict": (engine.config["train_batch_size"], engine.config["gradient_accumulation_steps"]),
           "after": _boundaries(engine, 8), "steps": engine.global_steps}
    _boundaries(engine, 1)  # one micro-step into a window
    try:
        engine.set_train_batch_size(4)
    except RuntimeError as exc:
        out["mid_window"] = str(exc)
    for bad in (0, 3, 2.0, True):
        try:
            engine.set_train_batch_size(bad)
        except (ValueError, RuntimeError) as exc:
            out.setdefault("bad", []).append(type(exc).__name__ + ": " + str(exc))
    return out


def test_set_train_batch_size_starts_a_window_of_the_new_length():
    out = run_distributed(_ramp_up_body, world_size=1, timeout=60)[0]
    assert out["first"] == [False, True]
    assert (out["gas"], out["batch"], out["dict"]) == (4, 8, (8, 4))
    # the first window after the change is 4 micro-steps long, not cut short by the old count
    assert out["after"] == [False, False, False, True] * 2 and out["steps"] == 3
    assert "1 micro-step(s)" in out["mid_window"] and "engine.step()" in out["mid_window"]
    assert len(out["bad"]) == 4 and all("train_batch_size=" in b or "micro-step" in b for b in out["bad"])
    assert "accepted: a positive multiple of train_micro_batch_size_per_gpu x data-parallel size = 2" in out["bad"][1]


def _micro_batch_body() -> tuple:
    engine = _engine({"gradient_accumulation_steps": 3})
    engine.set_train_micro_batch_size(5)
    return (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(), engine.train_batch_size())


def test_set_train_micro_batch_size_keeps_the_accumulation_steps():
    assert run_distributed(_micro_batch_body, world_size=1, timeout=60)[0] == (5, 3, 15)


def _keep(batch, state):
    return batch


def _post_process_body() -> bool:
    import deepspeed

    model = torch.nn.Linear(1, 1)
    data = torch.utils.data.TensorDataset(torch.arange(8.0).view(8, 1))
    engine, _, loader, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=data,
        config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.set_data_post_process_func(_keep)
    return loader is engine.training_dataloader and engine.training_dataloader.post_process_func is _keep


def test_set_data_post_process_func_reaches_the_training_loader():
    assert run_distributed(_post_process_body, world_size=1, timeout=60)[0] is True


def _consolidated_body(stage: int) -> dict:
    engine = _engine({"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True})
    try:
        state = engine._consolidated_16bit_state_dict()
    except ValueError as exc:
        return {"error": str(exc)}
    full = {k: v.clone() for k, v in state.items()}
    return {"keys": sorted(full), "shapes": {k: tuple(v.shape) for k, v in full.items()}}


def test_consolidated_16bit_state_dict_at_zero3_and_its_error_elsewhere():
    z3 = run_distributed(_consolidated_body, world_size=2, args=(3,), timeout=90)[0]
    assert z3["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert z3["shapes"]["0.weight"] == (8, 4) and z3["shapes"]["2.weight"] == (1, 8)
    z0 = run_distributed(_consolidated_body, world_size=1, args=(0,), timeout=60)[0]
    assert "neither partitioned (ZeRO stage 3) nor tensor-parallel sharded" in z0["error"]


def test_accelerator_names_its_op_builders():
    from deepspeed.accelerator import get_accelerator
    from ds_ops.op_builder import CPUAdamBuilder

    acc = get_accelerator()
    assert acc.get_op_builder("CPUAdamBuilder") is CPUAdamBuilder
    assert isinstance(acc.create_op_builder("CPUAdamBuilder"), CPUAdamBuilder)
    assert acc.get_op_builder("NoSuchOpBuilder") is None and acc.create_op_builder("NoSuchOpBuilder") is None
    assert acc.get_op_builder("ds_report") is None  # only builder names
    assert acc.op_builder_dir() == "deepspeed.ops.op_builder"


def test_dotted_top_level_keys_have_no_effect_and_say_so():
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
           "zero_optimization.reduce_bucket_size": 4096, "zero_optimization.stage3_prefetch_bucket_size": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config(cfg, world_size=1)
    messages = [str(w.message) for w in caught if issubclass(w.category, InertConfigKeyWarning)]
    assert loaded.zero_optimization.reduce_bucket_size == 500_000_000  # as DeepSpeed: the dotted key is ignored
    assert len(messages) == 2 and '{"zero_optimization": {"reduce_bucket_size": ...}}' in messages[0]
    with pytest.raises(ConfigError, match="zero_optimisation.stage: unknown key"):
        load_config({"train_micro_batch_size_per_gpu": 2, "zero_optimisation.stage": 3}, world_size=1)


def _pipe_ramp_up_body() -> tuple:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    module = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)], num_stages=1,
                            loss_fn=torch.nn.functional.mse_loss)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    batches = iter([(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(2 + 3)])
    engine.train_batch(data_iter=batches)
    engine.set_train_batch_size(6)
    engine.train_batch(data_iter=batches)  # must take the 3 remaining micro-batches, no more
    leftover = sum(1 for _ in batches)
    return engine.micro_batches, engine.global_steps, leftover


def test_pipeline_engine_ramp_up_runs_the_new_number_of_micro_batches():
    assert run_distributed(_pipe_ramp_up_body, world_size=1, timeout=60)[0] == (3, 2, 0)
