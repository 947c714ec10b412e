"""Config keys DeepSpeed's parser reads and its engine acts on do the same here (issue 26): dataloader_drop_last,
gradient_allreduce_op, pipeline.use_reentrant, use_data_before_expert_parallelism, log_level, data_parallel_size
and data_types.buffer_dtype, each through ``deepspeed.initialize`` on gloo ranks."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from torch import nn

IN, OUT = 4, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 8), nn.Tanh(), nn.Linear(8, OUT))


def _base(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}


def _loader_lengths() -> tuple[int, int]:
    import deepspeed

    data = torch.utils.data.TensorDataset(torch.randn(10, IN), torch.randn(10, OUT))  # 5 samples per rank
    lengths = []
    for drop_last in (False, True):
        engine, _, loader, _ = deepspeed.initialize(model=_model(), config=_base(dataloader_drop_last=drop_last),
                                                    training_data=data)
        assert engine.dataloader_drop_last() is drop_last
        lengths.append((len(loader), sum(1 for _ in loader)))
    return tuple(lengths)


def test_dataloader_drop_last_drops_each_ranks_incomplete_micro_batch():
    keep, drop = run_distributed(_loader_lengths, world_size=2, timeout=90)[0]
    assert keep == (3, 3) and drop == (2, 2)  # 5 samples per rank, micro batch 2


def _one_step(op: str, stage: int) -> dict[str, torch.Tensor]:
    """One SGD step on rank-specific data; returns the updated weights and this rank's local gradient."""
    import deepspeed

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(2, IN, generator=gen), torch.randn(2, OUT, generator=gen)
    reference = _model()
    nn.functional.mse_loss(reference(x), y).backward()
    local = {n: p.grad.clone() for n, p in reference.named_parameters()}
    config = _base(gradient_allreduce_op=op, zero_optimization={"stage": stage}, zero_allow_untested_optimizer=True)
    engine, *_ = deepspeed.initialize(model=_model(), config=config)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    summed = {n: g.clone() for n, g in local.items()}
    for g in summed.values():
        dist.all_reduce(g)
    start = dict(_model().named_parameters())
    return {n: (p.detach() - start[n].detach(), summed[n]) for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gradient_allreduce_op_sum_adds_the_ranks_gradients(stage):
    """lr 0.1: 'sum' moves each weight by 0.1 * (g0 + g1), 'mean' by half that (DeepSpeed's gradient_average)."""
    for op, scale in (("sum", 1.0), ("mean", 0.5)):
        moves = run_distributed(_one_step, world_size=2, args=(op, stage), timeout=90)[0]
        for name, (moved, summed) in moves.items():
            torch.testing.assert_close(moved, -0.1 * scale * summed, rtol=1e-5, atol=1e-6, msg=f"{op} {name}")


def _pipeline_checkpoint_function(use_reentrant: bool | None) -> tuple[str, bool, bool]:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    module = PipelineModule([nn.Linear(IN, IN) for _ in range(4)], num_stages=2, loss_fn=nn.MSELoss())
    pipeline = {"activation_checkpoint_interval": 1}
    if use_reentrant is not None:
        pipeline["use_reentrant"] = use_reentrant
    engine, *_ = deepspeed.initialize(model=module, config=_base(pipeline=pipeline, gradient_accumulation_steps=2))
    reentrant = engine._reentrant_activation_checkpointing()  # DeepSpeed's query, read from the module
    engine.module.set_checkpoint_interval(0)
    return engine.module.activation_checkpoint_func.__name__, reentrant, engine._reentrant_activation_checkpointing()


@pytest.mark.parametrize(("use_reentrant", "function"), [(False, "non_reentrant_checkpoint"), (None, "checkpoint"),
                                                         (True, "checkpoint")])
def test_pipeline_use_reentrant_false_picks_the_non_reentrant_checkpoint(use_reentrant, function):
    assert run_distributed(_pipeline_checkpoint_function, world_size=2, args=(use_reentrant,),
                           timeout=90)[0] == (function, use_reentrant is not False, False)


def _expert_groups(data_before_expert: bool) -> list[int]:
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            expert = nn.Linear(IN, IN)
            self.moe = MoE(IN, expert, num_experts=2, ep_size=2, k=1, drop_tokens=False, min_capacity=0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.moe(x)[0]

    config = _base(use_data_before_expert_parallelism=data_before_expert)
    deepspeed.initialize(model=Net(), config=config)
    return groups._get_expert_parallel_group_ranks("ep_size_2")


@pytest.mark.parametrize(("data_before_expert", "rank0_group"), [(False, [0, 1]), (True, [0, 2])])
def test_use_data_before_expert_parallelism_lays_out_the_expert_groups(data_before_expert, rank0_group):
    got = run_distributed(_expert_groups, world_size=4, args=(data_before_expert,), timeout=120)
    assert got[0] == rank0_group


def _logger_level_and_mesh_error() -> tuple[int, str]:
    import deepspeed
    from deepspeed.utils import logger
    from ds_config import ConfigError

    before = logger.level
    try:
        deepspeed.initialize(model=_model(), config=_base(log_level="ERROR"))
        level = logger.level
    finally:
        logger.setLevel(before)  # the worker runs later tests that read the engine's warnings
    with pytest.raises(ConfigError, match=r"data_parallel_size: the data-parallel group has 2 ranks") as err:
        deepspeed.initialize(model=_model(), config=_base(data_parallel_size=4))
    deepspeed.initialize(model=_model(), config=_base(data_parallel_size=2))
    return level, str(err.value)


def test_log_level_sets_deepspeeds_logger_and_data_parallel_size_must_match():
    level, message = run_distributed(_logger_level_and_mesh_error, world_size=2, timeout=90)[0]
    assert level == logging.ERROR
    assert "set it to 2 or leave it out" in message


def _buffer_dtypes() -> tuple[str, str]:
    import deepspeed

    out = []
    for precision, buffers in (("bf16", None), ("fp16", None), ("bf16", "fp32"), ("bf16", "fp16")):
        model = nn.Sequential(nn.Linear(IN, IN), nn.BatchNorm1d(IN))
        data_types = {} if buffers is None else {"data_types": {"buffer_dtype": buffers}}
        config = _base(**{precision: {"enabled": True}}, **data_types)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        out.append(str(engine.module[1].running_mean.dtype))
        assert engine.module[0].weight.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return tuple(out)


def test_buffers_keep_their_dtype_unless_buffer_dtype_casts_them():
    # DeepSpeed 0.19.6+ casts parameters only: fp32 BatchNorm statistics stay fp32 under fp16/bf16
    assert run_distributed(_buffer_dtypes, world_size=1, timeout=90)[0] == (
        "torch.float32", "torch.float32", "torch.float32", "torch.float16")


def test_deepspeed_config_object_carries_the_new_keys_under_deepspeeds_attribute_names():
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = DeepSpeedConfig({"train_batch_size": 4, "dataloader_drop_last": True, "gradient_allreduce_op": "SUM",
                           "use_data_before_expert_parallelism": True, "log_level": "info",
                           "pipeline": {"use_reentrant": False}, "checkpoint": {"writer": {"type": "python"}}})
    assert (cfg.dataloader_drop_last, cfg.gradient_allreduce_op, cfg.use_data_before_expert_parallel_,
            cfg.log_level, cfg.managed_gradient_accumulation) == (True, "sum", True, "info", True)
    assert cfg.pipeline["use_reentrant"] is False
    assert cfg.checkpoint_config["writer"]["type"] == "PYTHON" and cfg.checkpoint_config["tag_validation"] == "WARN"
    assert "use_reentrant" not in DeepSpeedConfig({"train_batch_size": 4}).pipeline  # DeepSpeed's six defaults
