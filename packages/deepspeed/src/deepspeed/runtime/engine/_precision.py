"""Where precision plugs into the engine: the dtypes the module is cast to (DeepSpeed's mixed-precision policy:
parameters follow fp16/bf16, buffers keep their dtype unless ``data_types.buffer_dtype`` names one), the loss
scaler a config asks for, the dtypes of autocast, gradient accumulation and gradient communication, and DeepSpeed's
class for the stage-0 fp16/bf16 wrapper."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from deepspeed.runtime.precision.loss_scalers import DynamicLossScaler, build_loss_scaler
from deepspeed.runtime.precision.optimizers import MixedPrecisionOptimizer
from ds_config import ConfigError, ConfigProblem, DtypeEnum, InertConfigKeyWarning


class PrecisionMismatch(ConfigError, AssertionError):
    """``data_types.param_dtype`` off the training precision: a ``ConfigError`` naming the key, and the
    ``AssertionError`` DeepSpeed's engine raises for it."""


def torch_dtype(name: str) -> torch.dtype:
    """A config dtype name (``"bf16"``, ``"float16"``, ``"torch.float32"``, ``"half"``...) as a ``torch.dtype``."""
    return getattr(torch, DtypeEnum.parse(name).torch_name)


def is_zero_init_model(module: torch.nn.Module, zero_stage: int) -> bool:
    """Whether ZeRO-3 trains a model built under ``zero.Init`` (some parameter already partitioned): its
    partitions take the training dtype when the engine adopts them, not through the module cast."""
    return zero_stage == 3 and any(hasattr(p, "ds_id") for p in module.parameters())


def _training_dtype(engine: Any) -> torch.dtype | None:
    # a function, not a method: DeepSpeed's callers pass stand-ins with only the attributes listed below
    if engine.fp16_enabled():
        return torch.float16
    return torch.bfloat16 if engine.bfloat16_enabled() else None


class MixedPrecisionMethods:
    """DeepSpeedEngine's mixed-precision policy (FSDP's ``MixedPrecisionPolicy`` in DeepSpeed's words): the
    parameters in the fp16/bf16 training dtype, the buffers (rotary ``inv_freq``, BatchNorm statistics) in the
    dtype they were loaded with unless ``data_types.buffer_dtype`` names one. Over ``_config``,
    ``fp16_enabled()``, ``bfloat16_enabled()`` and ``module``."""

    def _assert_valid_mixed_precision_config(self) -> None:
        """``data_types.param_dtype``, when given, must be the training dtype: the optimizer wrappers, master
        weights and gradient reduction all follow fp16/bf16 ``enabled``, not this key."""
        name = self._config.param_dtype
        if name is None:
            return
        model_dtype = _training_dtype(self) or torch.float32
        if torch_dtype(name) != model_dtype:
            raise PrecisionMismatch(ConfigProblem("data_types.param_dtype", f"conflicts with the training dtype "
                                                  f"{model_dtype} (from fp16/bf16 'enabled'); set the matching "
                                                  "'enabled' flag or leave param_dtype out", name))

    def _mixed_precision_dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """``(param_dtype, buffer_dtype)`` of the module cast: the fp16/bf16 training dtype (None in fp32) and
        ``data_types.buffer_dtype`` (None: buffers keep their dtype)."""
        name = self._config.buffer_dtype
        return _training_dtype(self), (torch_dtype(name) if name is not None else None)

    def _cast_module_mixed_precision(self, param_dtype: torch.dtype | None, buffer_dtype: torch.dtype | None,
                                     is_zero_init_model: bool) -> None:
        """Cast the module's floating-point parameters to ``param_dtype`` (not those of a ``zero.Init`` model,
        whose partitions ZeRO-3 owns) and its floating-point buffers to ``buffer_dtype``; None leaves them."""
        if param_dtype is not None and not is_zero_init_model:
            for p in self.module.parameters():
                if p.is_floating_point() and p.dtype != param_dtype:
                    p.data = p.data.to(param_dtype)
        if buffer_dtype is not None:  # buffers are never partitioned, zero.Init or not
            for b in self.module.buffers():
                if b.is_floating_point() and b.dtype != buffer_dtype:
                    b.data = b.data.to(buffer_dtype)


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
