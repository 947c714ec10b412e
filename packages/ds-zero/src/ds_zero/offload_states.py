"""Move a ZeRO stage 1/2 optimizer's states to CPU memory and back (``engine.offload_states`` /
``engine.reload_states``, ``deepspeed.runtime.zero.offload_states``).

A state is moved by replacing the storage of the tensors that hold it (``t.data = t.data.to(device)``), so
every reference to them (the optimizer's state keyed by the master tensors, the engine's reducer, the
model's parameters) stays valid. The model's low-precision parameters are views into each group's flat
buffer: that buffer moves once and every parameter (and the rank's partition view) is re-pointed into it.
``reload_states`` puts each tensor back on the device it had before its first offload. The states:

- ``optim_states``: the wrapped optimizer's per-element states (e.g. Adam's ``exp_avg``/``exp_avg_sq``);
- ``hp_params``: the fp32 master partitions;
- ``lp_params``: the model's fp16/bf16 (or fp32) parameters, i.e. the groups' flat buffers;
- ``lp_grads``: the gradient partitions, the parameters' ``.grad`` and fp32 accumulation buffers;
- ``contiguous_grad_buffer``: the reducer's preallocated bucket buffers.

Offloading is local to each rank (no communication). While a state is off its device, the engine refuses to
train or load a checkpoint until ``reload_states`` (a loaded state would land beside the offloaded ones, and
not be moved back).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ds_config.zero import OffloadDeviceEnum, OffloadStateTypeEnum
from ds_zero.stage_1_and_2 import DeepSpeedZeroOptimizer

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum", "get_state_devices", "offload_states", "offloaded",
           "reload_states"]

_CPU = torch.device("cpu")


def _make_offload_state_key(key: str) -> str:
    """The optimizer-state key under which a state moved off the device keeps its host copy (DeepSpeed's
    ``<key>_offload_buffer``; DeepCompile's ``offload_adam_states`` pass stores Adam's moments there)."""
    return f"{key}_offload_buffer"


@dataclass(frozen=True)
class _Transfer:
    pin_memory: bool = False
    non_blocking: bool = False
    copy: bool = False  # copy even when already on the device (exercises re-pointing on CPU-only machines)


# per optimizer: state -> {id(holder): (holder, device before the first offload)}
_RECORDS: weakref.WeakKeyDictionary[Any, dict[OffloadStateTypeEnum, dict[int, tuple[Any, torch.device]]]] = \
    weakref.WeakKeyDictionary()


# ---- arguments ---------------------------------------------------------------------------------------------------
def _is_zero(obj: Any) -> bool:
    from ds_zero.zero3.optimizer import DeepSpeedZeroOptimizer_Stage3

    return isinstance(obj, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3))


def _zero_optimizer(obj: Any, call: str) -> Any:
    """``obj`` itself, or its ``.optimizer`` (an engine), when that is a ZeRO stage 1-3 optimizer."""
    if _is_zero(obj):
        return obj
    inner = getattr(obj, "optimizer", None)
    if _is_zero(inner):
        return inner
    got = type(obj).__name__ + (f" whose optimizer is {type(inner).__name__}" if hasattr(obj, "optimizer") else "")
    raise TypeError(f"{call}: expected a ZeRO optimizer (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3) or "
                    f"an engine using one (zero_optimization.stage 1-3), got {got}")


def _state(value: Any, call: str) -> OffloadStateTypeEnum:
    try:
        return OffloadStateTypeEnum(value)
    except ValueError:
        accepted = ", ".join(s.value for s in OffloadStateTypeEnum)
        raise ValueError(f"{call}: unknown state {value!r}; accepted: {accepted} (OffloadStateTypeEnum)") from None


def _states(include: Iterable[Any] | None) -> list[OffloadStateTypeEnum]:
    if include is None:
        return list(OffloadStateTypeEnum)
    if isinstance(include, (str, OffloadStateTypeEnum)):
        include = [include]
    return [_state(item, "offload_states: include") for item in include]


def _target(device: Any) -> torch.device:
    if isinstance(device, torch.device) and device.type == "cpu":
        return _CPU
    try:
        kind = OffloadDeviceEnum(device)
    except ValueError:
        kind = None
    if kind is OffloadDeviceEnum.cpu:
        return _CPU
    why = {OffloadDeviceEnum.none: "'none' means no offload", OffloadDeviceEnum.nvme: "NVMe is not supported for "
           "offloading states (as in DeepSpeed; NVMe holds states through offload_optimizer/offload_param device "
           "'nvme', ZeRO-Infinity)"}.get(kind, "unknown device")
    raise ValueError(f"offload_states: device {device!r} is not supported ({why}); accepted: 'cpu' "
                     "(OffloadDeviceEnum.cpu)")


# ---- what holds each state -----------------------------------------------------------------------------------------
def _optim_state_tensors(opt: DeepSpeedZeroOptimizer) -> list[torch.Tensor]:
    out = []
    for fg in opt.groups:
        out.extend(v for v in opt.optimizer.state.get(fg.master, {}).values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out


def _grad_tensors(opt: DeepSpeedZeroOptimizer) -> list[torch.Tensor]:
    out = [fg.grad_partition for fg in opt.groups if fg.grad_partition_allocated]
    for fg in opt.groups:
        for p in fg.params:
            out.extend(g for g in (p.grad, opt.get_grad(p)) if g is not None)
    unique = {id(t): t for t in out}  # p.grad and get_grad(p) are often the same tensor
    return list(unique.values())


def _holders(opt: DeepSpeedZeroOptimizer, state: OffloadStateTypeEnum) -> list[Any]:
    """The tensors (or, for ``lp_params``, the flat groups) that hold ``state``."""
    if state is OffloadStateTypeEnum.optim_states:
        return _optim_state_tensors(opt)
    # ZeRO-Infinity: masters (and states) on NVMe and partitions on NVMe are off the accelerator already
    if state is OffloadStateTypeEnum.hp_params:
        return [fg.master for fg in opt.groups if not getattr(fg, "master_on_nvme", False)]
    if state is OffloadStateTypeEnum.lp_params:
        return [fg for fg in opt.groups if fg.lp_flat is not None]
    if state is OffloadStateTypeEnum.lp_grads:
        return _grad_tensors(opt)
    return opt.reducer.buffers()


def _device_of(holder: Any) -> torch.device:
    return holder.device if isinstance(holder, torch.Tensor) else holder.lp_flat.device


# ---- moving ------------------------------------------------------------------------------------------------------
def _copied(t: torch.Tensor, device: torch.device, how: _Transfer) -> torch.Tensor:
    if t.device == device and not how.copy:
        return t
    if device.type == "cpu" and how.pin_memory and t.device.type != "cpu" and torch.cuda.is_available():
        out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device, pin_memory=True)
        out.copy_(t, non_blocking=how.non_blocking)
        return out
    return t.to(device, non_blocking=how.non_blocking, copy=how.copy)


def _move_group(fg: Any, device: torch.device, how: _Transfer) -> None:
    """Move a group's flat low-precision buffer and re-point the parameters (views into it)."""
    fg.lp_flat.data = _copied(fg.lp_flat.data, device, how)
    if hasattr(fg, "repoint"):  # ZeRO-3: the partitions are the views
        fg.repoint()
        return
    flat = fg.lp_flat.detach()
    start, end = fg.layout.partition_range(fg.rank)
    fg.lp_partition.data = flat[start:end]
    for p, offset in zip(fg.params, fg.layout.offsets, strict=True):
        p.data = flat[offset:offset + p.numel()].view(p.shape)


def _move(holder: Any, device: torch.device, how: _Transfer) -> None:
    if isinstance(holder, torch.Tensor):
        holder.data = _copied(holder.data, device, how)
    else:
        _move_group(holder, device, how)


def _release_device_memory(moved_from: set[torch.device]) -> None:
    """Hand the freed blocks back to the driver, so other work (the reason to offload) can use them."""
    if any(d.type == "cuda" for d in moved_from) and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _offload(opt: DeepSpeedZeroOptimizer, states: list[OffloadStateTypeEnum], device: torch.device,
             how: _Transfer) -> None:
    records = _RECORDS.setdefault(opt, {})
    moved_from: set[torch.device] = set()
    with torch.no_grad():
        for state in states:
            seen = records.setdefault(state, {})
            for holder in _holders(opt, state):
                before = _device_of(holder)
                seen.setdefault(id(holder), (holder, before))  # a second offload keeps the first device
                if before != device or how.copy:
                    moved_from.add(before)
                    _move(holder, device, how)
    _release_device_memory(moved_from - {device})


def _reload(opt: DeepSpeedZeroOptimizer, how: _Transfer) -> None:
    records = _RECORDS.pop(opt, {})
    with torch.no_grad():
        for seen in records.values():
            for holder, device in seen.values():
                if _device_of(holder) != device or how.copy:
                    _move(holder, device, how)


# ---- the API -----------------------------------------------------------------------------------------------------
def offload_states(optimizer: Any, include: Iterable[Any] | None = None,
                   device: Any = OffloadDeviceEnum.cpu, pin_memory: bool = True, non_blocking: bool = False) -> None:
    """Move ``optimizer``'s states (``include``: ``OffloadStateTypeEnum`` members or their names; default all)
    to ``device`` (only CPU). ``pin_memory`` pins the CPU copies (when CUDA is available), ``non_blocking``
    copies asynchronously on the current stream. ``optimizer`` is a ZeRO stage 1/2 optimizer or an engine."""
    opt = _zero_optimizer(optimizer, "offload_states")
    _offload(opt, _states(include), _target(device), _Transfer(bool(pin_memory), bool(non_blocking)))


def reload_states(optimizer: Any, non_blocking: bool = False) -> None:
    """Move every state moved by :func:`offload_states` back to the device it had (a no-op when none was)."""
    _reload(_zero_optimizer(optimizer, "reload_states"), _Transfer(non_blocking=bool(non_blocking)))


def offloaded(optimizer: Any) -> list[OffloadStateTypeEnum]:
    """The states :func:`offload_states` moved off their device and :func:`reload_states` has not yet moved
    back (offloading to the device a state is already on moves nothing)."""
    if not _is_zero(optimizer):  # e.g. a stage registered by a plug-in: never offloaded
        return []
    return [state for state, seen in _RECORDS.get(optimizer, {}).items()
            if any(_device_of(holder) != device for holder, device in seen.values())]


def get_state_devices(model: Any, state: Any) -> set[torch.device]:
    """The devices holding ``state`` (an ``OffloadStateTypeEnum``) of ``model`` (an engine, or the ZeRO
    optimizer itself); empty when nothing holds it (e.g. optimizer states before the first step)."""
    opt = _zero_optimizer(model, "get_state_devices")
    kind = _state(state, "get_state_devices")
    devices = {_device_of(h) for h in _holders(opt, kind)}
    if kind is OffloadStateTypeEnum.lp_params:
        devices.update(p.device for fg in opt.groups for p in fg.params)
    return devices

