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


def register(optimizer: Any, params: list[torch.nn.Parameter]) -> None:
    ref = weakref.ref(optimizer)
    for p in params:
        _OWNERS[p] = ref


def owner_of(param: torch.nn.Parameter) -> Any | None:
    """The live ZeRO optimizer that partitions ``param``, or None."""
    ref = _OWNERS.get(param)
    return ref() if ref is not None else None
