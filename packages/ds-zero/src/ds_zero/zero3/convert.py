"""Partitioning a whole parameter in place (``convert_param``): this rank's slice into ``ds_tensor``, DeepSpeed's
``ds_*`` attributes, and the per-parameter ``all_gather`` / ``partition`` / ``ds_summary`` methods DeepSpeed's
parameters carry. Sits above ``param`` (the partition state) and ``_collectives`` (which moves values), since a
converted parameter's ``all_gather`` is a collective."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ds_zero.zero3._collectives import gather_now, start_gather
from ds_zero.zero3._guard import guard
from ds_zero.zero3.param import (
    PartitionSpace,
    ZeroParamStatus,
    is_partitioned,
    partition_numel,
    release_one,
)

_IDS = itertools.count()


def convert_param(param: torch.nn.Parameter, space: PartitionSpace, dtype: torch.dtype | None = None) -> None:
    """Partition ``param`` in place: keep this rank's slice of its current (whole) value in ``ds_tensor`` and
    attach DeepSpeed's ``ds_*`` attributes. The whole value must be the same on every rank."""
    if is_partitioned(param):
        return
    full = param.data
    dtype = dtype or full.dtype
    part = partition_numel(full.numel(), space.world)
    local = torch.zeros(part, dtype=dtype, device=space.device)
    start = min(space.rank * part, full.numel())
    end = min(start + part, full.numel())
    with torch.no_grad():
        local[:end - start].copy_(full.reshape(-1)[start:end])
    local.ds_numel = part  # DeepSpeed's ds_tensor carries it too
    param.ds_tensor = local
    param.ds_id = next(_IDS)
    param.ds_numel = full.numel()
    param.ds_shape = full.shape
    param.ds_space = space
    param.ds_persist = False
    param.is_external_param = False  # DeepSpeed's flag: gathered with a module other than its owner
    param.ds_pending = None  # the PendingGather bringing it while INFLIGHT
    param.ds_active_sub_modules = set()
    param.ds_process_group = space.group
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    param.data = torch.empty(0, dtype=dtype, device=space.compute_device)
    param.all_gather = _bound(all_gather_params, param)
    param.all_gather_coalesced = _bound(CoalescedGather, param)
    param.partition = _bound(release_params, param)
    param.ds_summary = _bound(_summary, param)
    param.partition_numel = _bound(_partition_numel, param)  # DeepSpeed's: elements of this rank's partition
    guard(param)


def _bound(fn: Any, param: torch.nn.Parameter) -> Any:
    # a closure over a weak reference would do too; the parameter owning its own bound helpers is what DeepSpeed
    # does, and the cycle is collected with the parameter
    def call(param_list: Any = None, **kwargs: Any) -> Any:
        return fn(list(param_list) if param_list is not None else [param], **kwargs)
    return call


def _partition_numel(params: list[torch.nn.Parameter]) -> int:
    return params[0].ds_tensor.numel()


def _summary(params: list[torch.nn.Parameter]) -> dict[str, Any]:
    p = params[0]
    return {"id": p.ds_id, "status": p.ds_status.name, "numel": p.numel(), "ds_numel": p.ds_numel,
            "shape": tuple(p.shape), "ds_shape": tuple(p.ds_shape), "requires_grad": p.requires_grad,
            "persist": p.ds_persist, "active_sub_modules": sorted(p.ds_active_sub_modules)}


def all_gather_params(params: list[torch.nn.Parameter], **_: Any) -> None:
    """Gather the whole value of every parameter that is not available (collective over their group)."""
    gather_now([p for p in params if is_partitioned(p)])


class CoalescedGather:
    """``param.all_gather_coalesced(params)``: DeepSpeed's asynchronous gather of a list of parameters (one
    exchange per process group); ``wait()`` installs the whole values. Parameters already available are left as
    they are, ones in flight are waited for. ``quantize=True`` (DeepSpeed's per-call qwZ) is refused: quantized
    gathers here follow ``zero_quantized_weights``; ``safe_mode`` is accepted (gathers check sizes anyway)."""

    def __init__(self, params: list[torch.nn.Parameter], safe_mode: bool = False, quantize: bool = False) -> None:
        if quantize:
            raise ValueError("all_gather_coalesced(quantize=True): per-call quantized gathers are not supported; "
                             "set zero_optimization.zero_quantized_weights to quantize every gather")
        partitioned = [p for p in params if is_partitioned(p)]
        needed = [p for p in partitioned if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
        self._inflight = [p for p in partitioned if p.ds_status is ZeroParamStatus.INFLIGHT]
        self._pending = start_gather(needed) if needed else None

    def wait(self, handle_dependency: bool = True) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        gather_now(self._inflight)


def release_params(params: list[torch.nn.Parameter], **_: Any) -> None:
    """Drop the whole values (persistent parameters keep theirs); the partitions stay."""
    for p in params:
        if is_partitioned(p) and not p.ds_active_sub_modules:
            release_one(p)
