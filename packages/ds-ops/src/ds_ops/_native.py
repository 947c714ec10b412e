"""ctypes bindings for the CPU optimizer kernels: one call updates a whole bucket of tensors.

A bucket shares (param, grad, state, copy) dtypes. The C side reads five addresses per tensor
(param, grad, state0, state1, copy; 0 = absent), the element counts, two per-tensor floats and the
hyper-parameters, and splits all elements across ``nthreads`` OpenMP threads.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from array import array
from collections.abc import Sequence

import torch

from ds_ops.op_builder import OpBuilder, OpBuildError

FALLBACK_ENV = "DS_OPS_ALLOW_TORCH_FALLBACK"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NO_COPY = -1
_ERRORS = {
    -1: "unsupported dtype code",
    -2: "grad dtype must equal the param dtype or be float32",
    -3: "state dtype must equal the param dtype or be float32",
    -4: "the fused low-precision copy needs float32 params",
}
_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int]


class NativeKernel:
    """One optimizer entry point of a loaded op library."""

    def __init__(self, lib: ctypes.CDLL, symbol: str) -> None:
        self.symbol = symbol
        self._fn = getattr(lib, symbol)
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int

    def __call__(self, slots: array, numels: array, per_tensor: array, hyper: Sequence[float],
                 dtypes: Sequence[int], nthreads: int) -> None:
        """Run the update; ``slots`` is array('q') of 5 addresses per tensor (the tensors must stay alive)."""
        hyper_arr = array("f", hyper)
        dtype_arr = array("i", dtypes)
        rc = self._fn(slots.buffer_info()[0], numels.buffer_info()[0], per_tensor.buffer_info()[0], len(numels),
                      hyper_arr.buffer_info()[0], dtype_arr.buffer_info()[0], nthreads)
        if rc != 0:
            raise RuntimeError(f"{self.symbol} failed: {_ERRORS.get(rc, f'error {rc}')} (dtypes {list(dtypes)})")


def fallback_allowed(argument: bool | None) -> bool:
    """The explicit argument wins; otherwise ``DS_OPS_ALLOW_TORCH_FALLBACK=1`` allows the torch fallback."""
    if argument is not None:
        return bool(argument)
    return os.environ.get(FALLBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def load_kernel(builder_cls: type[OpBuilder], symbol: str, owner: str, allow_fallback: bool | None
                ) -> NativeKernel | None:
    """The native kernel, or None (with a warning) when it cannot be built and the fallback is allowed."""
    try:
        return NativeKernel(builder_cls().load(), symbol)
    except (OpBuildError, ValueError) as exc:
        if not fallback_allowed(allow_fallback):
            raise OpBuildError(f"{owner} needs the native op {builder_cls.NAME!r}: {exc}") from exc
        warnings.warn(
            f"{owner}: native op {builder_cls.NAME!r} unavailable ({exc}); using the slower pure-torch "
            "implementation because the torch fallback is allowed.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
