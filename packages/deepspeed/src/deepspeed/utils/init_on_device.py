"""``deepspeed.OnDevice``: construct a model's tensors directly on a device (``"meta"`` by default) in a dtype.

    with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
        model = MyModel()          # every parameter and buffer: meta, fp16 where floating point

Built on torch's own machinery, a ``TorchFunctionMode`` over torch's tensor factories (``empty``, ``zeros``,
``ones``, ``full``, ``rand``, ``arange``, ``tensor``, ...): a call that gives no ``device`` gets the context's
(as under ``with torch.device(...)``), and a floating-point result gets the context's dtype, an explicit
floating ``dtype=`` included (as in DeepSpeed); integer, bool and complex tensors keep theirs.
``enabled=False`` makes the context a no-op; nested contexts apply the innermost enabled one and give the
outer one back on exit. Unlike DeepSpeed's, which swaps ``torch.empty``/``zeros``/``ones``/``full`` for the
whole process, it applies to the entering thread only; the legacy ``torch.Tensor(*sizes)`` constructor is
not intercepted (torch modules build their tensors with the factories).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["OnDevice"]

# Factories whose result is the default floating dtype when no dtype is given; the others infer theirs from
# their arguments (full(2, 1) is int64), so their floating results are converted after the call.
_DEFAULT_FLOAT = ("empty", "empty_strided", "empty_permuted", "zeros", "ones", "rand", "randn", "eye", "linspace",
                  "logspace", "bartlett_window", "blackman_window", "hamming_window", "hann_window", "kaiser_window")
_INFERRED = ("full", "arange", "range", "tensor", "scalar_tensor", "randint", "randperm", "tril_indices",
             "triu_indices")


def _factories(names: tuple[str, ...]) -> frozenset[Callable[..., Any]]:
    return frozenset(getattr(torch, n) for n in names if hasattr(torch, n))


_DEFAULT_FLOAT_FNS = _factories(_DEFAULT_FLOAT)
_FACTORY_FNS = _DEFAULT_FLOAT_FNS | _factories(_INFERRED)

_active = threading.local()  # .modes: this thread's entered _FactoryMode objects, innermost last


def _innermost() -> _FactoryMode | None:
    modes = getattr(_active, "modes", None)
    return modes[-1] if modes else None


class _FactoryMode(TorchFunctionMode):
    """Fills in device and floating dtype for the factory calls of the innermost enabled ``OnDevice``."""

    def __init__(self, device: torch.device, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.device, self.dtype = device, dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = dict(kwargs or {})
        # An outer context sees the inner one's calls again (the inner one runs them): leave them alone.
        if func not in _FACTORY_FNS or _innermost() is not self:
            return func(*args, **kwargs)
        if kwargs.get("device") is None:
            kwargs["device"] = self.device
        if self.dtype is None:
            return func(*args, **kwargs)
        asked = kwargs.get("dtype")
        if (asked is None and func in _DEFAULT_FLOAT_FNS) or (asked is not None and asked.is_floating_point):
            kwargs["dtype"] = self.dtype
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.dtype != self.dtype:
            out = out.detach().to(self.dtype).requires_grad_(out.requires_grad)
        return out


class OnDevice:
    """Create modules' tensors on ``device`` with floating-point tensors in ``dtype`` (DeepSpeed's signature).

    ``dtype=None`` keeps every dtype and only places tensors. ``device`` is anything ``torch.device`` accepts.
    """

    def __init__(self, dtype: torch.dtype | None, device: str | torch.device | int = "meta",
                 enabled: bool = True) -> None:
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"OnDevice(dtype={dtype!r}): expected a torch.dtype such as torch.float16, or None")
        self.dtype = dtype
        self.device = device
        self.enabled = enabled
        self._torch_device = torch.device(device)  # a bad device string fails here, not inside the model
        self._modes: list[_FactoryMode] = []

    def __enter__(self) -> OnDevice:
        if self.enabled:
            mode = _FactoryMode(self._torch_device, self.dtype)
            mode.__enter__()
            if not hasattr(_active, "modes"):
                _active.modes = []
            _active.modes.append(mode)
            self._modes.append(mode)
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if self._modes:
            mode = self._modes.pop()
            _active.modes.remove(mode)
            mode.__exit__(exc_type, exc_value, traceback)

    def __repr__(self) -> str:
        return f"OnDevice(dtype={self.dtype}, device={self.device!r}, enabled={self.enabled})"
