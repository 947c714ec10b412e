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
import torch.distributed as dist

from deepspeed.runtime._grad_reduce import BucketedAllReduce, ReduceOptions
from deepspeed.runtime._loss_scaler import DynamicLossScaler, build_loss_scaler
from deepspeed.runtime._precision import FP32Optimizer, MixedPrecisionOptimizer
from deepspeed.runtime.optimizer_wrapper import GradientReducer, OptimizerWrapper
from ds_config import ConfigError, ConfigProblem
from ds_zero._grad_norm import LOCAL, norm_scope

_LOW_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


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
    0: "deepspeed.runtime._setup:build_stage0",
    1: "deepspeed.runtime._zero_setup:build_zero_stage",
    2: "deepspeed.runtime._zero_setup:build_zero_stage",
    3: "deepspeed.runtime._zero3_setup:build_zero3_stage",
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


def prepare_module(module: torch.nn.Module, config: Any, device: torch.device) -> torch.nn.Module:
    """Move ``module`` to ``device`` and cast its floating-point parameters to the training dtype (fp16/bf16).

    Buffers keep the dtype they were loaded with (fp32 BatchNorm statistics, rotary ``inv_freq``), as DeepSpeed
    0.19.6+ does; ``data_types.buffer_dtype`` casts them (``_engine_setup.cast_buffers``)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"deepspeed.initialize: model must be a torch.nn.Module, got {type(module).__name__}")
    module.to(device)
    low = _LOW_DTYPES.get(config.precision)
    if low is not None:
        with torch.no_grad():
            for param in module.parameters():
                if param.is_floating_point() and param.dtype != low:
                    param.data = param.data.to(low)
    return module


def broadcast_module(module: torch.nn.Module, dp_group: Any, params: list[torch.nn.Parameter] | None = None) -> None:
    """Give every data-parallel rank rank 0's parameters (``params``, default all) and buffers (ranks may have
    initialised differently)."""
    if not dist.is_initialized() or dist.get_world_size(dp_group) == 1:
        return
    src = dist.get_global_rank(dp_group, 0) if dp_group is not None else 0
    params = list(module.parameters()) if params is None else params
    with torch.no_grad():
        for tensor in [*params, *module.buffers()]:
            dist.broadcast(tensor.data, src=src, group=dp_group)


def _loss_scaler(config: Any) -> Any:
    """fp16's scaler; ``torch_autocast`` with float16 gets GradScaler's defaults (2**16, x2 every 2000)."""
    if config.fp16_enabled:
        return build_loss_scaler(config.fp16, config.dynamic_loss_scale_args)
    if config.torch_autocast_enabled and _autocast_dtype(config) == torch.float16:
        return DynamicLossScaler(init_scale=2.0 ** 16, scale_window=2000, min_scale=2.0 ** -24,
                                 raise_error_at_min_scale=False)
    return None


def _autocast_dtype(config: Any) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.torch_autocast.dtype, torch.bfloat16)


def _grad_accum_fp32(config: Any) -> bool:
    dtype = config.data_types.grad_accum_dtype
    if dtype is None:
        return False
    if dtype in ("fp32", "float32", "float"):
        return True
    if dtype == config.precision:
        return False
    raise ConfigError(ConfigProblem("data_types.grad_accum_dtype", f"cannot accumulate {config.precision} "
                                    "gradients in this dtype; accepted: fp32 or the training "
                                    f"dtype ({config.precision})", dtype))


def _comm_dtype(config: Any) -> torch.dtype | None:
    name = config.communication_data_type
    key = "communication_data_type"
    if config.sequence_parallel_size > 1:  # as DeepSpeed's engine: this one replaces it (default fp32)
        name, key = config.seq_parallel_communication_data_type, "seq_parallel_communication_data_type"
    if name is None:
        return None
    table = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if name not in table:
        raise ConfigError(ConfigProblem(key, "not usable for gradient reduction; accepted: fp32, fp16, bf16", name))
    return table[name]


def reduce_options(config: Any, params: list[torch.nn.Parameter], dp_group: Any, world: int) -> ReduceOptions:
    """The config's gradient-communication options (see ``_grad_reduce``)."""
    from deepspeed.runtime.torch_autocast import autocast_comm_dtypes

    autocast = autocast_comm_dtypes(params) if config.torch_autocast_enabled else {}
    return ReduceOptions(world_size=world, group=dp_group, communication_data_type=_comm_dtype(config),
                         fp32_allreduce=bool(config.fp32_allreduce), prescale_gradients=bool(config.prescale_gradients),
                         gradient_predivide_factor=float(config.gradient_predivide_factor), autocast_dtype_of=autocast,
                         average=config.gradient_allreduce_op == "mean")


def _legacy_class(optimizer: torch.optim.Optimizer, fp32_grad_accum: bool) -> type[MixedPrecisionOptimizer]:
    """DeepSpeed's class for the stage-0 fp16/bf16 wrapper: ``BF16_Optimizer`` with fp32 gradient accumulation,
    ``FP16_Optimizer`` around a fused optimizer (FusedAdam, 1-bit Adam), else ``FP16_UnfusedOptimizer``."""
    if fp32_grad_accum:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

        return BF16_Optimizer
    from deepspeed.runtime.fp16.onebit.adam import OnebitAdam
    from deepspeed.runtime.fp16.onebit.zoadam import ZeroOneAdam
    from ds_ops.adam.fused_adam import FusedAdam

    if isinstance(optimizer, FusedAdam | OnebitAdam | ZeroOneAdam):
        from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

        return FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    return FP16_UnfusedOptimizer


def build_stage0(inputs: StageInputs) -> tuple[OptimizerWrapper, GradientReducer]:
    """Plain data parallelism: the precision wrapper and an overlapped bucketed all-reduce."""
    config = inputs.config
    if config.amp_enabled:  # Apex AMP patches the model and optimizer itself; this engine does not drive it
        raise ConfigError(ConfigProblem("amp.enabled", "NVIDIA Apex AMP is not available in this version; use "
                                        "\"bf16\", \"fp16\" or \"torch_autocast\" instead", True))
    clip = float(config.gradient_clipping)
    scaler = _loss_scaler(config)
    check = config.precision in ("fp16", "bf16") and (config.fp16_enabled or config.bf16.check_grad_overflow)
    # only a wrapper that computes a norm (clipping, overflow checks) needs the mpu's model-parallel group
    scope = norm_scope(inputs.mpu) if clip > 0 or check or scaler is not None else LOCAL
    common = dict(clip=clip, loss_scaler=scaler, dp_group=inputs.dp_group, norm_scope=scope)
    if config.precision in ("fp16", "bf16"):
        fp32_accum = _grad_accum_fp32(config)
        wrapper: OptimizerWrapper = _legacy_class(inputs.basic_optimizer, fp32_accum).from_engine(
            inputs.basic_optimizer, low_precision_dtype=_LOW_DTYPES[config.precision], check_overflow=check,
            fp32_grad_accum=fp32_accum, **common)
    else:
        if config.data_types.grad_accum_dtype not in (None, "fp32", "float32"):
            raise ConfigError(ConfigProblem("data_types.grad_accum_dtype", "fp32 training accumulates gradients in "
                                            "fp32; accepted: fp32", config.data_types.grad_accum_dtype))
        wrapper = FP32Optimizer(inputs.basic_optimizer, **common)
    if getattr(inputs.basic_optimizer, "communicates_gradients", False):  # 1-bit optimizers average themselves
        from deepspeed.runtime.fp16.onebit._engine import attach  # (DeepSpeed: enable_backward_allreduce=False)

        return wrapper, attach(inputs.basic_optimizer, wrapper, inputs.dp_group)
    group = inputs.dp_group if inputs.reduce_group is None else inputs.reduce_group
    options = reduce_options(config, inputs.params, group, inputs.dp_world_size)  # averaged over data parallelism
    if any(getattr(p, "allreduce", True) is False for p in inputs.params):  # MoE experts: their own groups
        from deepspeed.runtime import _moe_setup

        return wrapper, _moe_setup.reducer(inputs.params, wrapper, options)
    return wrapper, BucketedAllReduce(inputs.params, wrapper, options)


def build_stage(inputs: StageInputs) -> tuple[OptimizerWrapper, GradientReducer]:
    """The optimizer wrapper and reducer of the configured ZeRO stage."""
    stage = inputs.config.zero_stage
    if stage not in STAGE_BUILDERS:
        raise ConfigError(ConfigProblem("zero_optimization.stage", "this ZeRO stage is not available in this version "
                                        f"of the engine; accepted: {sorted(STAGE_BUILDERS)}", stage))
    return _stage_builder(stage)(inputs)


def build_scheduler(client: Any, config: Any, wrapper: OptimizerWrapper) -> Any:
    """The client's schedule (an instance, or a callable taking the optimizer), else the config's, else None.

    As in DeepSpeed, a client schedule wins over the config's ``scheduler`` section (with a warning).
    """
    from deepspeed.runtime.lr_schedules import build_lr_scheduler
    from deepspeed.utils import logger

    if client is not None:
        if config.scheduler is not None:
            logger.warning("deepspeed.initialize: an lr_scheduler was passed, so the config's 'scheduler' section "
                           f"({config.scheduler.type}) is ignored")
        if hasattr(client, "step") and hasattr(client, "state_dict"):
            return client
        if callable(client):
            return client(wrapper.optimizer)
        raise TypeError(f"deepspeed.initialize: lr_scheduler={type(client).__name__} is neither a schedule (with "
                        "step/state_dict) nor a callable taking the optimizer")
    return build_lr_scheduler(config.scheduler, wrapper)


def build_monitor(config: Any) -> Any:
    """A ``ds_monitor.MonitorMaster`` when any monitor is enabled, else None."""
    if not any(getattr(config, s).enabled for s in ("tensorboard", "wandb", "comet", "csv_monitor")):
        return None
    from ds_monitor import MonitorMaster

    return MonitorMaster(config)


def build_flops_profiler(module: torch.nn.Module, config: Any, engine: Any) -> Any:
    """A ``ds_profiler.FlopsProfiler`` on ``module`` when ``flops_profiler.enabled``, else None."""
    if not config.flops_profiler.enabled:
        return None
    from ds_profiler import FlopsProfiler

    return FlopsProfiler(module, ds_engine=engine, recompute_fwd_factor=config.flops_profiler.recompute_fwd_factor)
