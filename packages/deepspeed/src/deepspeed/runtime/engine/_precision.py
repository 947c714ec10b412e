"""Where precision plugs into the engine: the loss scaler a config asks for, the dtypes of autocast, gradient
accumulation and gradient communication, and DeepSpeed's class for the stage-0 fp16/bf16 wrapper."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from deepspeed.runtime.precision.loss_scalers import DynamicLossScaler, build_loss_scaler
from deepspeed.runtime.precision.optimizers import MixedPrecisionOptimizer
from ds_config import ConfigError, ConfigProblem, InertConfigKeyWarning


def loss_scaler(config: Any) -> Any:
    """fp16's scaler; ``torch_autocast`` with float16 gets GradScaler's defaults (2**16, x2 every 2000)."""
    if config.fp16_enabled:
        return build_loss_scaler(config.fp16, config.dynamic_loss_scale_args)
    if config.torch_autocast_enabled and autocast_dtype(config) == torch.float16:
        return DynamicLossScaler(init_scale=2.0 ** 16, scale_window=2000, min_scale=2.0 ** -24,
                                 raise_error_at_min_scale=False)
    return None


def autocast_dtype(config: Any) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.torch_autocast.dtype, torch.bfloat16)


class UnsupportedPrecisionMix(ConfigError, NotImplementedError):
    """A ``grad_accum_dtype`` the engine cannot accumulate in: a ``ConfigError`` naming the key, and the
    ``NotImplementedError`` DeepSpeed raises for the same mix."""


def grad_accum_fp32(config: Any) -> bool:
    dtype = config.data_types.grad_accum_dtype
    if dtype is None:
        return False
    if dtype in ("fp32", "float32", "float"):
        return True
    if dtype == config.precision:
        return False
    if config.zero_stage > 0:  # as DeepSpeed: ZeRO reduces in the training dtype whatever this asks for
        warnings.warn(f"config key 'data_types.grad_accum_dtype' ({dtype}) has no effect with ZeRO stage "
                      f"{config.zero_stage}: gradients accumulate in the training dtype ({config.precision}), as "
                      "in DeepSpeed", InertConfigKeyWarning, stacklevel=2)
        return False
    raise UnsupportedPrecisionMix(ConfigProblem("data_types.grad_accum_dtype", f"cannot accumulate "
                                                f"{config.precision} gradients in this dtype; accepted: fp32 or "
                                                f"the training dtype ({config.precision})", dtype))


def comm_dtype(config: Any) -> torch.dtype | None:
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


def legacy_class(optimizer: torch.optim.Optimizer, fp32_grad_accum: bool) -> type[MixedPrecisionOptimizer]:
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
