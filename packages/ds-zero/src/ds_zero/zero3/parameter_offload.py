"""DeepSpeed's ``optimizer.parameter_offload`` (a ``DeepSpeedZeRoOffload``) over this ZeRO-3's scheduler.

Clients reach into it to take ZeRO-3's hooks off around generation with every weight gathered, and to put them
back (TRL's ``unwrap_model_for_generation`` under ZeRO-3: ``forward_hooks`` / ``backward_hooks`` removed and emptied,
``param_coordinator._invalidate_trace()``, ``_register_deepspeed_module(module)``). Here the forward hooks are the
scheduler's; backward needs no module hooks of its own (the gathers for backward hang on the forward outputs), so
``backward_hooks`` starts empty.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_zero.zero3.schedule import ParamScheduler
from ds_zero.zero3.schedule import _ZeroParamDict as ZeROOrderedDict  # DeepSpeed's name for a module's _parameters
from ds_zero.zero3.schedule import ensure_param_table as ensure_zero_ordered_dict

__all__ = ["DeepSpeedZeRoOffload", "PartitionedParameterCoordinator", "ZeROOrderedDict", "ensure_zero_ordered_dict"]


class PartitionedParameterCoordinator:
    """DeepSpeed's ``param_coordinator``: the recorded module order that drives prefetch."""

    def __init__(self, scheduler: ParamScheduler) -> None:
        self._scheduler = scheduler

    def is_invalid_trace(self) -> bool:
        return self._scheduler.trace_invalid

    def _invalidate_trace(self) -> None:
        self._scheduler.invalidate_trace()

    def release_and_reset_all(self, module: torch.nn.Module | None = None) -> None:
        self._scheduler.release_all()


class DeepSpeedZeRoOffload:
    """The ZeRO-3 hooks of one model, as DeepSpeed's ``parameter_offload`` object shows them."""

    def __init__(self, scheduler: ParamScheduler) -> None:
        self._scheduler = scheduler
        self.param_coordinator = PartitionedParameterCoordinator(scheduler)
        self.backward_hooks: list[Any] = []

    @property
    def module(self) -> torch.nn.Module:
        return self._scheduler.root

    @property
    def forward_hooks(self) -> list[Any]:
        return self._scheduler.hook_handles

    @forward_hooks.setter
    def forward_hooks(self, handles: list[Any]) -> None:
        self._scheduler.hook_handles = handles

    def get_param_coordinator(self) -> PartitionedParameterCoordinator:
        return self.param_coordinator

    def _register_deepspeed_module(self, module: torch.nn.Module, count: Any = None) -> None:
        """Put the hooks back on the model (after ``forward_hooks`` were removed); the next pass traces afresh."""
        if module is not self._scheduler.root:
            raise ValueError(f"_register_deepspeed_module: {type(module).__name__} is not the module this ZeRO-3 "
                             f"engine partitions ({type(self._scheduler.root).__name__}); pass "
                             "parameter_offload.module")
        self._scheduler.install_hooks()

    _register_hooks_recursively = _register_deepspeed_module  # DeepSpeed < 0.16.4's name

    def quantize_nontrainable_params(self) -> int:
        """With ``zero_quantized_nontrainable_weights``: store int8 the partitions of parameters frozen since the
        engine was built (DeepSpeed-Chat freezes them after LoRA conversion); returns how many were converted.
        Without the option, nothing to do (as in DeepSpeed)."""
        block = getattr(self._scheduler, "quantize_frozen_block", None)
        if block is None:
            return 0
        from ds_zero.zeropp.frozen import quantize_nontrainable

        return quantize_nontrainable(self._scheduler.root.parameters(), block)

    def empty_partition_cache(self) -> None:
        self._scheduler.release_all(include_persistent=True)
