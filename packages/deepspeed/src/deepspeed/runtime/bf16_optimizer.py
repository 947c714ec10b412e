"""``deepspeed.runtime.bf16_optimizer``: ``BF16_Optimizer``, bf16 parameters with fp32 masters and fp32 gradient
accumulation (each micro-step's bf16 gradient is added into an fp32 buffer): the engine's fp32-master wrapper
with ``fp32_grad_accum`` under DeepSpeed's constructor (see ``fp16._legacy``). No loss scaling (bf16)."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed.runtime.fp16.legacy import LegacyMixedPrecision
from ds_zero.optimizer_state import universal_checkpoint_info_of

__all__ = ["BF16_Optimizer"]


class BF16_Optimizer(LegacyMixedPrecision):  # noqa: N801 - DeepSpeed's name
    """bf16 training with fp32 masters and fp32 gradient accumulation; ``grad_acc_dtype`` must be fp32."""

    fp32_grad_accum_default = True

    def __init__(self, init_optimizer: torch.optim.Optimizer, param_names: dict[Any, str] | None,
                 bfloat16_config: Any = None, mpu: Any = None, clip_grad: float = 0.0, norm_type: float = 2,
                 allgather_bucket_size: int = 5_000_000_000, dp_process_group: Any = None, timers: Any = None,
                 grad_acc_dtype: torch.dtype | None = None, graph_harvesting: bool = False,
                 has_moe_layers: bool = False) -> None:
        if grad_acc_dtype not in (None, torch.float32):
            raise ValueError(f"BF16_Optimizer: grad_acc_dtype={grad_acc_dtype!r}; accepted: torch.float32 (bf16 "
                             "gradients are accumulated in fp32)")
        if norm_type != 2:
            raise ValueError(f"BF16_Optimizer: norm_type={norm_type!r}; accepted: 2 (the L2 norm clipping uses)")
        super().__init__(init_optimizer, loss_scale_config=None, low_precision_dtype=torch.bfloat16, mpu=mpu,
                         clip_grad=clip_grad, dp_group=dp_process_group)
        self.param_names = param_names or {}
        self.bfloat16_config = bfloat16_config
        self.norm_type = norm_type
        self.allgather_bucket_size = int(allgather_bucket_size)
        self.timers = timers
        self.grad_acc_dtype = torch.float32
        self.graph_harvesting = graph_harvesting
        self.has_moe_layers = has_moe_layers
        self._enable_universal_checkpoint()

    @property
    def bf16_groups(self) -> list[list[torch.nn.Parameter]]:
        """The model's bf16 parameters per group (DeepSpeed's name; an attribute there, so it can be assigned:
        the assigned lists are returned from then on)."""
        pinned = self.__dict__.get("_bf16_groups")
        return pinned if pinned is not None else self.fp16_groups

    @bf16_groups.setter
    def bf16_groups(self, groups: list[list[torch.nn.Parameter]]) -> None:
        self.__dict__["_bf16_groups"] = groups

    def _enable_universal_checkpoint(self) -> None:
        """Cache the parameters' universal-checkpoint description (``param.universal_checkpoint_info``)."""
        self._universal_checkpoint_info = universal_checkpoint_info_of(self.bf16_groups)

    def _get_universal_checkpoint_info(self) -> Any:
        return getattr(self, "_universal_checkpoint_info", None)
