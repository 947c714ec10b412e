"""Hyper-parameter checks shared by the optimizers: each error names the optimizer, key and accepted range."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def _number(owner: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}: {key}={value!r} is invalid; expected a finite number")
    return float(value)


def check_group(owner: str, group: Mapping[str, Any]) -> None:
    """Validate the hyper-parameters present in a param group (lr, betas, eps, weight_decay, amsgrad)."""
    if "lr" in group and _number(owner, "lr", group["lr"]) < 0:
        raise ValueError(f"{owner}: lr={group['lr']!r} is invalid; expected lr >= 0")
    if "eps" in group and _number(owner, "eps", group["eps"]) < 0:
        raise ValueError(f"{owner}: eps={group['eps']!r} is invalid; expected eps >= 0")
    if "weight_decay" in group and _number(owner, "weight_decay", group["weight_decay"]) < 0:
        raise ValueError(f"{owner}: weight_decay={group['weight_decay']!r} is invalid; expected weight_decay >= 0")
    if "betas" in group:
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{owner}: betas={betas!r} is invalid; expected a pair (beta1, beta2)")
        for i, beta in enumerate(betas):
            if not 0.0 <= _number(owner, f"betas[{i}]", beta) < 1.0:
                raise ValueError(f"{owner}: betas[{i}]={beta!r} is invalid; expected 0 <= beta < 1")
    if group.get("amsgrad", False):
        raise ValueError(f"{owner}: amsgrad=True is not supported (the AMSGrad variant is not implemented); "
                         "use amsgrad=False")
    if group.get("maximize", False):
        raise ValueError(f"{owner}: maximize=True is not supported; negate the loss instead")
