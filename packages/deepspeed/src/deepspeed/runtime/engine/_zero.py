"""ZeRO stages 1 and 2 for the engine: ``zero_optimization`` (and the precision sections) -> a ds-zero
``DeepSpeedZeroOptimizer`` and its reducer, plus the checkpoint extension that writes its shards.

Every documented ``zero_optimization`` field is either honoured by ds-zero or rejected here with the reason
(features that belong to stage 3, ZeRO++, MiCS, NVMe, ZenFlow).
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed import comm
from deepspeed.runtime.engine._precision import comm_dtype, grad_accum_fp32, loss_scaler
from deepspeed.runtime.engine._stages import StageInputs
from deepspeed.runtime.optimizer_wrapper import GradientReducer, OptimizerWrapper
from ds_config import ConfigError, ConfigProblem
from ds_zero.utils import ZeRORuntimeException


def _problem(key: str, why: str, value: Any) -> ConfigProblem:
    return ConfigProblem(f"zero_optimization.{key}", why, value)


def _unsupported(zero: Any, stage: int) -> list[ConfigProblem]:
    """Options of ``zero_optimization`` that stages 1/2 cannot honour, each with its reason."""
    problems = []
    stage3 = f"is a ZeRO stage 3 feature (this config uses stage {stage}); accepted here"
    off = zero.offload_optimizer
    if off is not None and str(off.device).endswith("nvme"):
        problems.append(_problem("offload_optimizer.device", f"NVMe optimizer offload {stage3}: none or cpu",
                                 "nvme"))
    if off is not None and float(off.ratio) != 1.0:
        problems.append(_problem("offload_optimizer.ratio", f"partial optimizer offload {stage3}: 1.0", off.ratio))
    if off is not None and off.super_offload:
        problems.append(_problem("offload_optimizer.super_offload", f"SuperOffload {stage3}: false", True))
    par = zero.offload_param
    if par is not None and not str(par.device).endswith("none"):
        problems.append(_problem("offload_param.device", f"parameter offload {stage3}: none", str(par.device)))
    # ZenFlow runs at stages 1/2 (ds_zero.zenflow); zero_settings checks what of it this version honours
    problems += [p for p in zero_plus_plus_problems(zero, f"ZeRO++/MiCS {stage3}") if not p.path.endswith(".zenflow")]
    if zero.legacy_stage1:
        problems.append(_problem("legacy_stage1", "the legacy stage 1 implementation is not available; "
                                 "accepted: false", True))
    return problems


def zero_plus_plus_problems(zero: Any, why: str) -> list[ConfigProblem]:
    """ZeRO++ (qwZ, qgZ, hpZ), MiCS and ZenFlow options set away from their off value, each with ``why``."""
    problems = []
    for key, value, accepted in (("zero_quantized_weights", zero.zero_quantized_weights, False),
                                 ("zero_quantized_gradients", zero.zero_quantized_gradients, False),
                                 ("zero_quantized_nontrainable_weights", zero.zero_quantized_nontrainable_weights,
                                  False),
                                 ("zero_hpz_partition_size", zero.zero_hpz_partition_size, 1),
                                 ("mics_shard_size", zero.mics_shard_size, -1)):
        if value != accepted and not (key == "mics_shard_size" and value == 0):
            problems.append(_problem(key, f"{why}: {accepted}", value))
    if zero.zenflow is not None:
        problems.append(_problem("zenflow", "ZenFlow is not available in this version; accepted: null", "{...}"))
    return problems


def offload_pinning(pin_memory: bool) -> Any:
    """How ZeRO pins its CPU-offload buffers: through the accelerator under ``DS_PIN_MEMORY_BACKEND=native``
    (page-locked on every device, registered with the native manager, freed by ``engine.destroy()``), else
    ds-zero's default (torch pinning where CUDA is available), as before the native backend existed."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils.pin_memory import get_active_native_pinned_memory
    from ds_zero.host_pinning import TORCH_PINNING, HostPinning

    if not pin_memory or get_active_native_pinned_memory() is None:
        return TORCH_PINNING
    accelerator = get_accelerator()
    return HostPinning(pin=accelerator.pin_memory, unpin=accelerator.unpin_memory)


def zero_settings(config: Any) -> Any:
    """The ds-zero settings of a ZeRO stage 1/2 config (raises ``ConfigError`` listing every unsupported option)."""
    from ds_zero.stage_1_and_2 import ReduceSettings, ZeroSettings
    from ds_zero.zenflow.plan import unsupported as zenflow_unsupported

    zero, stage = config.zero_optimization, config.zero_stage
    problems = _unsupported(zero, stage) + zenflow_unsupported(config)
    if config.amp_enabled:
        problems.append(ConfigProblem("amp.enabled", "NVIDIA Apex AMP is not available with ZeRO; use \"bf16\" or "
                                      "\"fp16\"", True))
    if problems:
        raise ConfigError(*problems)
    off = zero.offload_optimizer
    offload = "cpu" if off is not None and str(off.device).endswith("cpu") else None
    pin = bool(off.pin_memory) if offload else False
    reduce = ReduceSettings(
        bucket_numel=int(zero.reduce_bucket_size), overlap_comm=bool(zero.overlap_comm),
        contiguous_gradients=bool(zero.contiguous_gradients), reduce_scatter=bool(zero.reduce_scatter),
        use_multi_rank_bucket_allreduce=bool(zero.use_multi_rank_bucket_allreduce),
        ignore_unused_parameters=bool(zero.ignore_unused_parameters),
        comm_dtype=comm_dtype(config) or (torch.float32 if config.fp32_allreduce else None),
        prescale_gradients=bool(config.prescale_gradients),
        gradient_predivide_factor=float(config.gradient_predivide_factor),
        average=config.gradient_allreduce_op == "mean")
    check = (config.fp16_enabled or (config.precision == "bf16" and config.bf16.check_grad_overflow)
             or loss_scaler(config) is not None)  # torch_autocast fp16 scales the loss too
    return ZeroSettings(stage=stage, reduce=reduce, allgather_bucket_numel=int(zero.allgather_bucket_size),
                        allgather_partitions=bool(zero.allgather_partitions),
                        round_robin_gradients=bool(zero.round_robin_gradients),
                        load_from_fp32_weights=bool(zero.load_from_fp32_weights),
                        clip=float(config.gradient_clipping), check_overflow=bool(check),
                        fp32_grad_accum=grad_accum_fp32(config) and config.precision in ("fp16", "bf16"),
                        offload_device=offload,
                        pin_memory=pin, host_pinning=offload_pinning(pin))


class ForcedCPUOptimizerError(ConfigError, ZeRORuntimeException):
    """``zero_force_ds_cpu_optimizer`` refused a client optimizer: a config error, and DeepSpeed's
    ``ZeRORuntimeException`` so code catching that still catches it."""


def check_client_offload_optimizer(optimizer: torch.optim.Optimizer, config: Any) -> None:
    """A client's optimizer with ``offload_optimizer`` (cpu or nvme) must be a DeepSpeed CPU optimizer unless
    ``zero_force_ds_cpu_optimizer`` is false. As in DeepSpeed, the config's own ``optimizer`` section is not
    checked: ``torch_adam: true`` there asks for torch's Adam on purpose."""
    if not config.zero_force_ds_cpu_optimizer:
        return
    from ds_zero.stage_1_and_2 import is_ds_cpu_optimizer

    if not is_ds_cpu_optimizer(optimizer):
        why = (f"offload_optimizer.device=cpu steps on the CPU, and {type(optimizer).__name__} is not a DeepSpeed "
               "CPU optimizer (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion); use one, let the config's "
               "'optimizer' section build it, or set zero_force_ds_cpu_optimizer to false")
        raise ForcedCPUOptimizerError(ConfigProblem("zero_force_ds_cpu_optimizer", why, True))


def moe_group_comms(optimizer: torch.optim.Optimizer, dp_world_size: int) -> dict[int, Any]:
    """Parameter-group index -> ds-zero ``GroupComm`` for the MoE expert groups (``moe=True``, ``name`` = the
    expert group name) of ``optimizer``: partitioned over their expert-data-parallel group, gradients divided by
    the whole data-parallel size. Expert parameters outside such a group are an error, as in DeepSpeed."""
    flagged = [i for i, group in enumerate(optimizer.param_groups) if group.get("moe")]
    stray = [i for i, group in enumerate(optimizer.param_groups) if not group.get("moe")
             and any(getattr(p, "allreduce", True) is False and p.requires_grad for p in group["params"])]
    if stray:
        raise ValueError(f"ZeRO stage 1/2: optimizer parameter groups {stray} hold MoE expert parameters but are not "
                         "marked 'moe': build the groups with deepspeed.moe.utils."
                         "split_params_into_different_moe_groups_for_optimizer")
    if not flagged:
        return {}
    from ds_moe import groups
    from ds_zero.stage_1_and_2 import GroupComm

    comms = {}
    for i in flagged:
        group = optimizer.param_groups[i]
        name = group.get("name")
        plain = [tuple(p.shape) for p in group["params"] if getattr(p, "allreduce", True) is not False]
        if plain:
            raise ValueError(f"ZeRO stage 1/2: parameter group {i} is marked 'moe' but holds parameters of shapes "
                             f"{plain[:5]} that are not expert parameters")
        comms[i] = GroupComm(groups._get_expert_data_parallel_group(name),
                             groups._get_expert_data_parallel_world_size(name), grad_divisor=float(dp_world_size))
    return comms


def build_zero_stage(inputs: StageInputs) -> tuple[OptimizerWrapper, GradientReducer]:
    """Stage 1 or 2 (``inputs.config.zero_stage``): the partitioned optimizer wrapper and its reducer."""
    from deepspeed.__about__ import __version__
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer  # with DeepSpeed's reduction API
    from deepspeed.sequence.groups import sequence_factor, zero12_group_comms
    from ds_zero.checkpoint import ZeroCheckpointShards
    from ds_zero.grad_norm import norm_scope

    config = inputs.config
    settings = zero_settings(config)
    names: dict[torch.nn.Parameter, str] = {}
    for name, p in inputs.module.named_parameters():
        names.setdefault(p, name)
    group, group_comms = inputs.dp_group, moe_group_comms(inputs.basic_optimizer, inputs.dp_world_size)
    if sequence_factor(inputs.reduce_group, inputs.dp_group, inputs.dp_world_size) > 1:  # over seq x data ranks
        group = inputs.reduce_group
        # AutoSP: each rank's loss is the loss of its own shard, so gradients average over the sequence ranks too
        divisor = comm.get_world_size(group) if config.compile.autosp else inputs.dp_world_size
        group_comms = zero12_group_comms(inputs.basic_optimizer, group, divisor)
    # through deepspeed.comm, so the comms logger and failure notes see ZeRO's collectives too
    kind, extra = DeepSpeedZeroOptimizer, {}
    if config.zero_optimization.zenflow is not None:  # checked by zero_settings: CPU offload, fixed intervals
        from ds_zero.zenflow import ZenFlowPlan, ZenFlowZeroOptimizer

        kind, extra = ZenFlowZeroOptimizer, {"zenflow": ZenFlowPlan.from_config(config.zero_optimization.zenflow)}
    wrapper = kind(inputs.basic_optimizer, inputs.params, names, settings,
                   loss_scaler=loss_scaler(config), dp_group=group, comm=comm,
                   norm_scope=norm_scope(inputs.mpu), group_comms=group_comms, **extra)
    wrapper.checkpoint_shards = (ZeroCheckpointShards(wrapper, inputs.module, config.to_dict(), __version__,
                                                      bf16=config.precision == "bf16"),)
    return wrapper, wrapper.reducer

