"""``deepspeed.utils.nvtx``: mark a function's calls as named ranges in the accelerator's profiler timeline.

``instrument_w_nvtx(fn)`` opens a range named ``fn.__qualname__`` around every call (NVTX on CUDA, a
``torch.profiler`` record on CPU). Accelerators that group ranges in domains (``supports_nvtx_domain``) get
them in the ``"DeepSpeed"`` domain; others take the plain ``range_push(msg)`` / ``range_pop()`` calls. Nothing is
recorded while ``torch.compile`` traces (a range call would break the graph) or when ``enable_nvtx`` is False.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from torch.compiler import is_compiling

from deepspeed.accelerator import get_accelerator

enable_nvtx = True
DEEPSPEED_NVTX_DOMAIN = "DeepSpeed"

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["DEEPSPEED_NVTX_DOMAIN", "enable_nvtx", "instrument_w_nvtx"]


def _push(accelerator: Any, msg: str) -> Any:
    if getattr(accelerator, "supports_nvtx_domain", False):
        return accelerator.range_push(msg, domain=DEEPSPEED_NVTX_DOMAIN)
    return accelerator.range_push(msg)


def _pop(accelerator: Any) -> Any:
    if getattr(accelerator, "supports_nvtx_domain", False):
        return accelerator.range_pop(domain=DEEPSPEED_NVTX_DOMAIN)
    return accelerator.range_pop()


def instrument_w_nvtx(func: F) -> F:
    """Wrap ``func`` so each call is one range named ``func.__qualname__`` (closed also when ``func`` raises,
    so an exception does not leave the timeline's range stack unbalanced)."""

    @functools.wraps(func)
    def wrapped_fn(*args: Any, **kwargs: Any) -> Any:
        # read the module's switches at call time: they may be flipped after decoration
        if not enable_nvtx or is_compiling():
            return func(*args, **kwargs)
        accelerator = get_accelerator()
        _push(accelerator, func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            _pop(accelerator)

    return wrapped_fn  # type: ignore[return-value]
