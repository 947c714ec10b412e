"""Which ZeRO optimizer owns a model parameter (for the ``safe_*`` debug APIs and ``offload_states``).

A weak mapping keyed by identity (tensors compare elementwise, so a plain ``WeakKeyDictionary`` cannot hold
them), so a discarded engine's optimizer is not kept alive by its parameters.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

_OWNERS = WeakIdKeyDictionary()
_MASTERS = WeakIdKeyDictionary()  # param -> (weakref to the torch optimizer, its whole fp32 master)


def register(optimizer: Any, params: list[torch.nn.Parameter]) -> None:
    ref = weakref.ref(optimizer)
    for p in params:
        _OWNERS[p] = ref


def register_masters(optimizer: torch.optim.Optimizer, masters: dict[torch.nn.Parameter, torch.Tensor]) -> None:
    """Stage 0 with fp16/bf16: each parameter's whole (unpartitioned) fp32 master inside ``optimizer``, which
    the ``safe_*`` APIs read and write as DeepSpeed's BF16_Optimizer allows."""
    ref = weakref.ref(optimizer)
    for p, master in masters.items():
        _MASTERS[p] = (ref, master)


def unpartitioned_master(param: torch.nn.Parameter) -> tuple[torch.optim.Optimizer, torch.Tensor] | None:
    """``(torch optimizer, fp32 master)`` of a stage-0 mixed-precision parameter, or None."""
    entry = _MASTERS.get(param)
    optimizer = entry[0]() if entry is not None else None
    return None if optimizer is None else (optimizer, entry[1])


def owner_of(param: torch.nn.Parameter) -> Any | None:
    """The live ZeRO optimizer that partitions ``param``, or None."""
    ref = _OWNERS.get(param)
    return ref() if ref is not None else None


def release(optimizer: Any, params: Any) -> None:
    """Forget ``optimizer`` (a ZeRO or stage-0 wrapper) as the owner of ``params``: its engine was released, and
    the ``safe_*`` APIs must not read its stale partitions or masters. A newer owner's entries are kept."""
    inner = getattr(optimizer, "optimizer", None)
    for p in params:
        ref = _OWNERS.get(p)
        if ref is not None and ref() is optimizer:
            del _OWNERS[p]
        entry = _MASTERS.get(p)
        if entry is not None and inner is not None and entry[0]() is inner:
            del _MASTERS[p]
