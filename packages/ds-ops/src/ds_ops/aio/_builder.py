"""``AsyncIOBuilder`` and ``PinMemoryBuilder``: the op-builder faces of this module, as DeepSpeed scripts call them.

``deepspeed.ops.op_builder.AsyncIOBuilder().load()`` returns the op module (``ds_ops.aio.async_io``) whose
``aio_handle`` is the handle type. Nothing is compiled: the bindings use cffi's ABI mode (see the package
docstring), so ``load`` only imports, and the op is usable everywhere Python's os.preadv exists (libaio, or the
thread-pool fallback).
"""

from __future__ import annotations

import os
from types import ModuleType

from ds_ops.aio import _libaio, async_io, pin_memory


class AsyncIOBuilder:
    """Builder of the ``async_io`` op (DeepSpeed's ``AsyncIOBuilder``)."""

    BUILD_VAR = "DS_BUILD_AIO"
    NAME = "async_io"

    def __init__(self) -> None:
        self.name = self.NAME

    def absolute_name(self) -> str:
        return "deepspeed.ops.aio"

    def is_compatible(self, verbose: bool = False) -> bool:
        """True where the op works: with libaio, or through the thread-pool fallback (POSIX preadv)."""
        ok = not self.compatibility_problems()
        if verbose:
            reason = _libaio.unavailable_reason()
            backend = "libaio" if reason is None else f"thread-pool fallback ({reason})"
            print(f"{self.NAME}: {'compatible' if ok else 'incompatible (no os.preadv)'}, backend: {backend}")
        return ok

    def compatibility_problems(self) -> list[str]:
        """What prevents the op from working here (empty: it works, through libaio or the fallback)."""
        return [] if hasattr(os, "preadv") and hasattr(os, "pwritev") else ["no os.preadv/os.pwritev here"]

    def is_built(self) -> str:
        """Nothing is compiled (cffi ABI mode); says which backend handles get: "libaio" or "threads"."""
        return "libaio" if _libaio.unavailable_reason() is None else "threads"

    def libaio_available(self) -> bool:
        """Whether libaio.so.1 loads here (otherwise handles use the fallback)."""
        return _libaio.unavailable_reason() is None

    def sources(self) -> list[str]:
        """No native sources: the bindings are cffi ABI-mode Python (``ds_ops/aio/_libaio.py``)."""
        return []

    def load(self, verbose: bool = True) -> ModuleType:
        """The op module ``ds_ops.aio.async_io``: ``aio_handle`` (= ``AsyncIOHandle``) and friends."""
        if not self.is_compatible():
            raise RuntimeError(f"{self.NAME}: this platform has no os.preadv/os.pwritev")
        return async_io

    jit_load = load


class PinMemoryBuilder:
    """Builder of the ``pin_memory`` op (DeepSpeed's ``PinMemoryBuilder``): page-locked CPU buffers without libaio.

    ``load()`` returns ``ds_ops.aio.pin_memory``, whose ``pin_handle`` shares the locked-buffer manager with
    ``aio_handle``. Like async_io, nothing is compiled: ``mlock`` is called through cffi's ABI mode.
    """

    BUILD_VAR = "DS_BUILD_PIN_MEMORY"
    NAME = "pin_memory"

    def __init__(self) -> None:
        self.name = self.NAME

    def absolute_name(self) -> str:
        return "deepspeed.ops.pin_memory.pin_memory_op"

    def compatibility_problems(self) -> list[str]:
        """What prevents the op from working here: it needs POSIX ``mlock`` (not on Windows)."""
        return [] if os.name == "posix" else [f"pin_memory needs POSIX mlock; this is {os.name!r}"]

    def is_compatible(self, verbose: bool = False) -> bool:
        problems = self.compatibility_problems()
        if verbose:
            print(f"{self.NAME}: " + ("compatible" if not problems else "incompatible (" + "; ".join(problems) + ")"))
        return not problems

    def is_built(self) -> bool:
        """Nothing to compile (cffi ABI mode): built wherever it is compatible."""
        return self.is_compatible()

    def sources(self) -> list[str]:
        return []

    def load(self, verbose: bool = True) -> ModuleType:
        """The op module ``ds_ops.aio.pin_memory`` (``pin_handle``)."""
        problems = self.compatibility_problems()
        if problems:
            raise RuntimeError(f"{self.NAME}: " + "; ".join(problems))
        return pin_memory

    jit_load = load
