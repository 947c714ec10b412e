"""``torch_autocast``: run ``engine.forward`` under ``torch.autocast`` (the documented helper functions).

``init_autocast_params`` marks the parameters of the lower-precision-safe modules with the autocast dtype;
gradient communication downcasts exactly those (``autocast_comm_dtypes``). ``autocast_context`` is what the
engine enters around the module's forward, handling an outer user autocast as documented: with
``torch_autocast`` enabled the config's dtype wins (info logged once); with it disabled autocast is turned
off inside the engine (warning logged once).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch

from deepspeed.utils import logger

PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"
"""The parameter attribute holding its gradient-communication dtype under torch_autocast (DeepSpeed's name)."""
_AUTOCAST_DTYPE_ATTR = PARAM_COMM_DTYPE_ATTR_NAME
_state = {"initialized": False, "nested_info": False, "nested_warning": False}


def get_default_autocast_lower_precision_modules() -> list[str]:
    """The module classes downcast for communication when ``lower_precision_safe_modules`` is not set."""
    from ds_config.precision import DEFAULT_AUTOCAST_LOWER_PRECISION_MODULES

    return list(DEFAULT_AUTOCAST_LOWER_PRECISION_MODULES)


def _resolve_class(path: str) -> type:
    module_name, _, class_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"torch_autocast.lower_precision_safe_modules: cannot import {path!r}; accepted: "
                         "dotted class paths such as 'torch.nn.Linear'") from exc
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ValueError(f"torch_autocast.lower_precision_safe_modules: {path!r} is not a torch.nn.Module class")
    return cls


def init_autocast_params(engine: Any, dtype: torch.dtype,
                         torch_autocast_lower_precision_safe_modules: list[str] | None) -> None:
    """Mark the parameters of ``engine``'s (or a module's) lower-precision-safe modules with ``dtype``."""
    module = engine.module if hasattr(engine, "module") else engine
    paths = torch_autocast_lower_precision_safe_modules
    classes = tuple(_resolve_class(p) for p in (paths if paths is not None else
                                                get_default_autocast_lower_precision_modules()))
    for sub in module.modules():
        if isinstance(sub, classes):
            for p in sub.parameters(recurse=False):
                setattr(p, _AUTOCAST_DTYPE_ATTR, dtype)
    _state["initialized"] = True


def is_autocast_initialized() -> bool:
    """True once ``init_autocast_params`` has run in this process."""
    return _state["initialized"]


def has_comm_dtype(param: torch.nn.Parameter) -> bool:
    """Whether ``init_autocast_params`` gave ``param`` a communication dtype."""
    return hasattr(param, PARAM_COMM_DTYPE_ATTR_NAME)


def get_comm_dtype(param: torch.nn.Parameter) -> torch.dtype:
    """``param``'s communication dtype (its own dtype when autocast did not mark it)."""
    return getattr(param, PARAM_COMM_DTYPE_ATTR_NAME, param.dtype)


def autocast_comm_dtypes(params: list[torch.nn.Parameter]) -> dict[torch.nn.Parameter, torch.dtype]:
    """Parameter -> communication dtype for the parameters ``init_autocast_params`` marked."""
    return {p: getattr(p, _AUTOCAST_DTYPE_ATTR) for p in params if hasattr(p, _AUTOCAST_DTYPE_ATTR)}


def autocast_context(enabled: bool, dtype: torch.dtype, device_type: str) -> contextlib.AbstractContextManager:
    """The context the engine's forward runs in (see the module docstring)."""
    outer = torch.is_autocast_enabled(device_type)
    if enabled:
        if outer and not _state["nested_info"]:
            _state["nested_info"] = True
            logger.info(f"torch_autocast: an outer torch.autocast is active; engine.forward uses the config's "
                        f"dtype {dtype}")
        return torch.autocast(device_type=device_type, dtype=dtype)
    if outer:
        if not _state["nested_warning"]:
            _state["nested_warning"] = True
            logger.warning("torch.autocast is active around engine.forward but torch_autocast is disabled in the "
                           "DeepSpeed config: autocast is disabled inside engine.forward (DeepSpeed's own "
                           "fp16/bf16 handles precision)")
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()
