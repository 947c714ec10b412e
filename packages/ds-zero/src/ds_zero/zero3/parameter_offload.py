"""DeepSpeed's ``optimizer.parameter_offload`` (a ``DeepSpeedZeRoOffload``) over this ZeRO-3's scheduler.

Clients reach into it to take ZeRO-3's hooks off around generation with every weight gathered, and to put them
back (TRL's ``unwrap_model_for_generation`` under ZeRO-3: ``forward_hooks`` / ``backward_hooks`` removed and emptied,
``param_coordinator._invalidate_trace()``, ``_register_deepspeed_module(module)``). Here the forward hooks are the
scheduler's; backward needs no module hooks of its own (the gathers for backward hang on the forward outputs), so
``backward_hooks`` starts empty.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ds_zero.zero3.param import ZeroParamStatus
from ds_zero.zero3.schedule import ParamScheduler, _ZeroParamDict, ensure_param_table

# A compiler-driven ZeRO-3 (DeepCompile) that runs forwards without the module hooks installs two callables here:
# ``() -> its active eager-fallback tracker or None`` and ``() -> is this read Dynamo's guard evaluation``.
eager_fallback_hooks: tuple[Callable[[], Any], Callable[[], bool]] | None = None


def print_rank_0(message: str, force: bool = False) -> None:
    """DeepSpeed's debug print of this module (shown on rank 0 only when ``force``)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if force and (not distributed or torch.distributed.get_rank() == 0):
        print(message)


class ZeROOrderedDict(_ZeroParamDict):
    """DeepSpeed's ``ZeROOrderedDict`` (a module's ``_parameters``). While ``_in_forward`` is set (a forward run
    without the module hooks, under DeepCompile), reading a released parameter gathers it and reports it to the
    active eager-fallback tracker, except for a read made by Dynamo's guards (they must see it released)."""

    _in_forward = False

    def __getitem__(self, key: str) -> Any:
        param = super().__getitem__(key)
        if param is None or not hasattr(param, "ds_status") or not self._in_forward or \
                torch.compiler.is_compiling():
            return param
        fallback, in_guard = None, False
        if eager_fallback_hooks is not None:
            fallback = eager_fallback_hooks[0]()
            in_guard = fallback is not None and eager_fallback_hooks[1]()
        if param.ds_status == ZeroParamStatus.AVAILABLE:
            if fallback is not None and not in_guard:
                fallback.record_param_access(param)
            return param
        if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            return param
        if in_guard:  # gathering here would hold a whole parameter before the compiled forward starts
            fallback.record_guard_suppressed_param(param)
            return param
        param.all_gather()
        if fallback is not None:
            fallback.record_gathered_param(param)
        print_rank_0(f"Registering external parameter from getter {key} ds_id = {param.ds_id}")
        return param

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


def ensure_zero_ordered_dict(module: Any, keep_original: bool = True) -> None:
    """DeepSpeed's ``ensure_zero_ordered_dict``: ``module._parameters`` becomes a :class:`ZeROOrderedDict` (a plain
    dict is copied into one, see ``schedule.ensure_param_table``; the scheduler's own table changes class)."""
    ensure_param_table(module, keep_original)
    table = getattr(module, "_parameters", None)
    if type(table) is _ZeroParamDict:
        table.__class__ = ZeROOrderedDict


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
