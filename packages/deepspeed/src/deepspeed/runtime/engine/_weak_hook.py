"""A parameter hook that holds its engine weakly."""

from __future__ import annotations

import weakref
from typing import Any

import torch


def weak_hook(method: Any) -> Any:
    """``method`` as a parameter hook that does not keep its engine alive: torch holds parameter hooks from C++,
    where the garbage collector cannot see the cycle back to the parameter, so a bound method would keep a
    dropped engine (its model, optimizer states and ZeRO-3's ``F.linear`` claim) in memory for good."""
    ref = weakref.WeakMethod(method)

    def hook(param: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(param)

    return hook
