"""Engine setup for DeepCompile over ZeRO-3 (``init_z3``) and the Dynamo settings it needs.

A ZeRO-3 parameter's ``data`` is empty while released and whole while gathered, so Dynamo must not specialize
on parameter shapes (``force_parameter_static_shapes`` / ``force_nn_module_property_static_shapes`` off while
a DeepCompile ZeRO-3 engine lives). Those settings are process-wide: every engine holds a claim and the values
before the first claim come back when the last claim is released, in whatever order engines go.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

_MISSING = object()
_DYNAMO_SETTINGS = ("force_parameter_static_shapes", "force_nn_module_property_static_shapes")
_claims: dict[int, dict[str, Any]] = {}  # id(dynamo config) -> {"config", "saved", "owners"}
_claims_lock = threading.Lock()


def _dynamo_config() -> Any:
    dynamo = getattr(torch, "_dynamo", None)
    if dynamo is None:
        try:
            import torch._dynamo as dynamo
        except ImportError:
            return None
    return getattr(dynamo, "config", None)


def _allow_dynamo_dynamic_parameter_shapes_for_z3(compile_kwargs: dict) -> Callable[[], None] | None:
    """Turn Dynamo's static parameter shapes off for one owner; returns the owner's release callback (None when
    this torch has neither setting)."""
    config = _dynamo_config()
    if config is None:
        return None
    token, key = object(), id(config)
    with _claims_lock:
        claim = _claims.get(key)
        if claim is None or claim["config"] is not config:
            saved = {name: getattr(config, name) for name in _DYNAMO_SETTINGS if hasattr(config, name)}
            if not saved:
                return None
            claim = _claims[key] = {"config": config, "saved": saved, "owners": set()}
        claim["owners"].add(token)
        for name in claim["saved"]:
            setattr(config, name, False)

    def release() -> None:
        with _claims_lock:
            current = _claims.get(key)
            if current is None or current["config"] is not config or token not in current["owners"]:
                return  # released already (idempotent)
            current["owners"].discard(token)
            if current["owners"]:
                return
            for name, value in current["saved"].items():
                setattr(config, name, value)
            del _claims[key]

    return release


def _resolve_expected_grad_dtype(param: Any) -> torch.dtype | None:
    """The dtype a gradient of ``param`` must have, as autograd's leaf accumulation decides it: the parameter's
    ``grad_dtype`` when set (None: any dtype is accepted), else the parameter's dtype."""
    grad_dtype = getattr(param, "grad_dtype", _MISSING)
    return param.dtype if grad_dtype is _MISSING else grad_dtype
