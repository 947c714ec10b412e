"""``deepspeed.utils.torch``: DeepSpeed's torch-version helpers (``required_torch_version``, ``register_grad_hook``).

Versions are compared with torch's own ``TorchVersion`` (PEP 440 ordering, as DeepSpeed's ``packaging`` parse), so
``required_torch_version(min_version=2.1)`` is true on ``2.1.0``, ``2.1.0+cu121`` and later.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.torch_version import TorchVersion

__all__ = ["is_functorch_transforming", "jit_script_compat", "register_grad_hook", "required_torch_version"]

_logger = logging.getLogger(__name__)


def required_torch_version(min_version: float | str | None = None, max_version: float | str | None = None) -> bool:
    """True when the installed torch is ``>= min_version`` and ``<= max_version`` (either bound may be omitted,
    not both; a float such as ``2.1`` reads as the version ``"2.1"``)."""
    if not (min_version or max_version):
        raise ValueError("required_torch_version: give min_version or max_version (or both)")
    current = TorchVersion(torch.__version__)
    if min_version and current < str(min_version):
        return False
    return not (max_version and current > str(max_version))


def register_grad_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
    """Run ``hook(param)`` after ``param``'s gradient has been accumulated; returns the removable handle.

    torch >= 2.1 has ``register_post_accumulate_grad_hook``; older versions hook the gradient accumulator node.
    """
    if required_torch_version(min_version="2.1"):
        return param.register_post_accumulate_grad_hook(hook)
    accumulator = param.expand_as(param).grad_fn.next_functions[0][0]
    return accumulator.register_hook(hook)


def is_functorch_transforming() -> bool:
    """True when called under a functorch transform (``torch.func.grad``, ``vmap``, ``jacrev``, ...)."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def jit_script_compat(fn: Callable) -> Any:
    """``fn`` compiled: ``torch.compile(fn)`` (lazy: compiled at the first call), else ``torch.jit.script(fn)``,
    else ``fn`` itself, as DeepSpeed 0.19 (TorchScript is deprecated)."""
    try:
        return torch.compile(fn)
    except Exception:  # noqa: BLE001 - any failure falls back, as DeepSpeed's
        _logger.debug("torch.compile failed for %r, falling back to torch.jit.script", fn, exc_info=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.script(_method)?` is deprecated.*",
                                    category=DeprecationWarning)
            return torch.jit.script(fn)
    except Exception:  # noqa: BLE001
        _logger.debug("torch.jit.script failed for %r, returning it unmodified", fn, exc_info=True)
        return fn
