"""``deepspeed.runtime.fp16.unfused_optimizer``: ``FP16_UnfusedOptimizer``, the stage-0 fp16/bf16 optimizer
DeepSpeed's engine builds around any other optimizer: the engine's fp32-master wrapper under DeepSpeed's
constructor (see ``fp16._legacy``); ``fp32_groups`` holds the masters per parameter group."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed.runtime.fp16.legacy import LegacyMixedPrecision
from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig, LossScaleProfile

__all__ = ["FP16_UnfusedOptimizer"]


class FP16_UnfusedOptimizer(LegacyMixedPrecision):  # noqa: N801 - DeepSpeed's name
    """fp16 (or bf16) parameters, fp32 masters; dynamic-scale defaults of the unfused profile (2**16)."""

    profile = LossScaleProfile.UNFUSED
    masters_key = "fp32_groups"

    def __init__(self, init_optimizer: torch.optim.Optimizer, deepspeed: Any = None,
                 loss_scale_config: LossScaleConfig | None = None, low_precision_dtype: torch.dtype = torch.float16,
                 static_loss_scale: float = 1.0, dynamic_loss_scale: bool = False,
                 dynamic_loss_args: dict[str, Any] | None = None, verbose: bool = True, mpu: Any = None,
                 clip_grad: float = 0.0, fused_lamb_legacy: bool = False) -> None:
        super().__init__(init_optimizer, loss_scale_config=loss_scale_config, low_precision_dtype=low_precision_dtype,
                         static_loss_scale=static_loss_scale, dynamic_loss_scale=dynamic_loss_scale,
                         dynamic_loss_args=dynamic_loss_args, mpu=mpu, clip_grad=clip_grad)
        self.deepspeed = deepspeed
        self.verbose = verbose
        self.fused_lamb_legacy = fused_lamb_legacy
