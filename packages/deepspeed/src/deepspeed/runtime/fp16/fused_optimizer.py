"""``deepspeed.runtime.fp16.fused_optimizer``: ``FP16_Optimizer``, the stage-0 fp16/bf16 optimizer DeepSpeed's
engine builds around a fused optimizer (``FusedAdam``, 1-bit Adam): the engine's fp32-master wrapper under
DeepSpeed's constructor (see ``fp16._legacy``)."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed.runtime.fp16.legacy import LegacyMixedPrecision
from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig, LossScaleProfile

__all__ = ["FP16_Optimizer"]


class FP16_Optimizer(LegacyMixedPrecision):  # noqa: N801 - DeepSpeed's name
    """fp16 (or bf16) parameters, fp32 masters in ``init_optimizer``; dynamic-scale defaults of the fused
    profile (initial scale ``initial_dynamic_scale``, 2**32)."""

    profile = LossScaleProfile.FUSED
    masters_key = "fp32_groups_flat"

    def __init__(self, init_optimizer: torch.optim.Optimizer, deepspeed: Any = None,
                 loss_scale_config: LossScaleConfig | None = None, low_precision_dtype: torch.dtype = torch.float16,
                 static_loss_scale: float = 1.0, dynamic_loss_scale: bool = False,
                 initial_dynamic_scale: float = 2.0 ** 32, dynamic_loss_args: dict[str, Any] | None = None,
                 verbose: bool = True, mpu: Any = None, clip_grad: float = 0.0, fused_adam_legacy: bool = False,
                 has_moe_layers: bool = False, timers: Any = None) -> None:
        super().__init__(init_optimizer, loss_scale_config=loss_scale_config, low_precision_dtype=low_precision_dtype,
                         static_loss_scale=static_loss_scale, dynamic_loss_scale=dynamic_loss_scale,
                         initial_dynamic_scale=initial_dynamic_scale, dynamic_loss_args=dynamic_loss_args, mpu=mpu,
                         clip_grad=clip_grad)
        self.deepspeed = deepspeed
        self.verbose = verbose
        self.fused_adam_legacy = fused_adam_legacy
        self.has_moe_layers = has_moe_layers
        self.timers = timers

    @property
    def fp32_groups_flat(self) -> list[torch.Tensor]:
        """Each group's fp32 master weights as one flat tensor (a copy: the masters stay per parameter here)."""
        return [torch.cat([m.detach().reshape(-1) for m in group]) if group else torch.empty(0)
                for group in self.fp32_groups]
