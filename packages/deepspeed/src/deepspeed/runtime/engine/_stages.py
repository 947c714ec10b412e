"""The engine's construction steps, one small function each: module placement and precision, the optimizer
wrapper and gradient reducer of the ZeRO stage, the LR schedule, the monitor and the flops profiler.

ZeRO stages plug in through ``STAGE_BUILDERS`` (stage -> ``"module:function"``, imported on first use so
stage 0 never loads the ZeRO optimizer) or ``register_zero_stage(stage, builder)``: a builder takes a ``StageInputs``
and returns ``(OptimizerWrapper, GradientReducer)`` (see ``optimizer_wrapper``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed.runtime.engine._module import LOW_DTYPES
from deepspeed.runtime.engine._precision import (
    UnsupportedPrecisionMix,
    comm_dtype,
    grad_accum_fp32,
    legacy_class,
    loss_scaler,
)
from deepspeed.runtime.grad_reduce import BucketedAllReduce, ReduceOptions
from deepspeed.runtime.optimizer_wrapper import GradientReducer, OptimizerWrapper
from deepspeed.runtime.precision.optimizers import FP32Optimizer
from ds_config import ConfigError, ConfigProblem
from ds_zero.grad_norm import LOCAL, norm_scope


@dataclass
class StageInputs:
    """What a ZeRO stage builder gets: the model, its trainable parameters, the basic optimizer, the typed
    config, the data-parallel group and size, and the model-parallel unit the engine was given (``mpu``:
    anything with ``get_model_parallel_group()`` and a tensor-parallel rank, e.g. ``PipelineParallelGrid``;
    None without model parallelism), over whose ranks gradient norms and overflow verdicts are agreed."""

    module: torch.nn.Module
    params: list[torch.nn.Parameter]
    basic_optimizer: torch.optim.Optimizer
    config: Any
    dp_group: Any
    dp_world_size: int
    scheduler: Any = None  # ZeRO-3: the partitioned model's gather/release scheduler
    mpu: Any = None
    reduce_group: Any = None  # stage 0: the group gradients are reduced over (sequence x data); None: dp_group


StageBuilder = Callable[[StageInputs], tuple[OptimizerWrapper, GradientReducer]]
STAGE_BUILDERS: dict[int, str | StageBuilder] = {
    0: "deepspeed.runtime.engine._stages:build_stage0",
    1: "deepspeed.runtime.engine._zero:build_zero_stage",
    2: "deepspeed.runtime.engine._zero:build_zero_stage",
    3: "deepspeed.runtime.engine._zero3:build_zero3_stage",
}
"""ZeRO stage -> its builder, or the ``"module:function"`` path of it (the ZeRO stages add rows here)."""


def register_zero_stage(stage: int, builder: StageBuilder) -> None:
    """Make ``zero_optimization.stage = stage`` build its optimizer wrapper and reducer with ``builder``."""
    STAGE_BUILDERS[stage] = builder


def _stage_builder(stage: int) -> StageBuilder:
    entry = STAGE_BUILDERS[stage]
    if isinstance(entry, str):
        module, _, function = entry.partition(":")
        entry = getattr(importlib.import_module(module), function)
        STAGE_BUILDERS[stage] = entry
    return entry


def reduce_options(config: Any, params: list[torch.nn.Parameter], dp_group: Any, world: int) -> ReduceOptions:
    """The config's gradient-communication options (see ``runtime.grad_reduce``)."""
    from deepspeed.runtime.torch_autocast import autocast_comm_dtypes

    autocast = autocast_comm_dtypes(params) if config.torch_autocast_enabled else {}
    return ReduceOptions(world_size=world, group=dp_group, communication_data_type=comm_dtype(config),
                         fp32_allreduce=bool(config.fp32_allreduce), prescale_gradients=bool(config.prescale_gradients),
                         gradient_predivide_factor=float(config.gradient_predivide_factor), autocast_dtype_of=autocast,
                         average=config.gradient_allreduce_op == "mean")


def build_stage0(inputs: StageInputs) -> tuple[OptimizerWrapper, GradientReducer]:
    """Plain data parallelism: the precision wrapper and an overlapped bucketed all-reduce."""
    config = inputs.config
    if config.amp_enabled:  # Apex AMP patches the model and optimizer itself; this engine does not drive it
        raise ConfigError(ConfigProblem("amp.enabled", "NVIDIA Apex AMP is not available in this version; use "
                                        "\"bf16\", \"fp16\" or \"torch_autocast\" instead", True))
    clip = float(config.gradient_clipping)
    scaler = loss_scaler(config)
    check = config.precision in ("fp16", "bf16") and (config.fp16_enabled or config.bf16.check_grad_overflow)
    # only a wrapper that computes a norm (clipping, overflow checks) needs the mpu's model-parallel group
    scope = norm_scope(inputs.mpu) if clip > 0 or check or scaler is not None else LOCAL
    common = dict(clip=clip, loss_scaler=scaler, dp_group=inputs.dp_group, norm_scope=scope)
    if config.precision in ("fp16", "bf16"):
        fp32_accum = grad_accum_fp32(config)
        wrapper: OptimizerWrapper = legacy_class(inputs.basic_optimizer, fp32_accum).from_engine(
            inputs.basic_optimizer, low_precision_dtype=LOW_DTYPES[config.precision], check_overflow=check,
            fp32_grad_accum=fp32_accum, **common)
    else:
        if config.data_types.grad_accum_dtype not in (None, "fp32", "float32"):
            raise UnsupportedPrecisionMix(ConfigProblem("data_types.grad_accum_dtype", "fp32 training accumulates "
                                                        "gradients in fp32; accepted: fp32",
                                                        config.data_types.grad_accum_dtype))
        wrapper = FP32Optimizer(inputs.basic_optimizer, **common)
    if getattr(inputs.basic_optimizer, "communicates_gradients", False):  # 1-bit optimizers average themselves
        from deepspeed.runtime.fp16.onebit.engine_hooks import attach  # (DeepSpeed: enable_backward_allreduce=False)

        return wrapper, attach(inputs.basic_optimizer, wrapper, inputs.dp_group)
    group = inputs.dp_group if inputs.reduce_group is None else inputs.reduce_group
    options = reduce_options(config, inputs.params, group, inputs.dp_world_size)  # averaged over data parallelism
    if any(getattr(p, "allreduce", True) is False for p in inputs.params):  # MoE experts: their own groups
        from deepspeed.runtime.engine import _moe

        return wrapper, _moe.reducer(inputs.params, wrapper, options)
    return wrapper, BucketedAllReduce(inputs.params, wrapper, options)


def build_stage(inputs: StageInputs) -> tuple[OptimizerWrapper, GradientReducer]:
    """The optimizer wrapper and reducer of the configured ZeRO stage."""
    stage = inputs.config.zero_stage
    if stage not in STAGE_BUILDERS:
        raise ConfigError(ConfigProblem("zero_optimization.stage", "this ZeRO stage is not available in this version "
                                        f"of the engine; accepted: {sorted(STAGE_BUILDERS)}", stage))
    return _stage_builder(stage)(inputs)
