"""``deepspeed.utils.pin_memory``: the native pinned-memory backend of the accelerator's ``pin_memory``.

``DS_PIN_MEMORY_BACKEND=native`` (default ``torch``) makes ``get_accelerator().pin_memory`` / ``pin_empty`` /
``is_pinned`` / ``unpin_memory`` go through :class:`NativePinnedMemory`: page-aligned host buffers locked in
RAM by the ``pin_memory`` op (``mlock``, or CUDA's pinned allocator), on every device, CPU included (torch
cannot pin CPU tensors without an accelerator). Where the accelerator can register host memory with its
runtime (CUDA's ``cudaHostRegister``), each buffer is registered too, so device copies from it are
asynchronous; ``DS_PIN_MEMORY_REGISTER_DEVICE=0`` keeps it to ``mlock``.

Ownership: a pinned buffer lives as long as the tensor :meth:`NativePinnedMemory.pin` returned *or any view
of it* (a finalizer on the allocation root frees it, as torch frees its pinned tensors), or until
:meth:`NativePinnedMemory.unpin`, which frees it at once; using the tensor or its views after ``unpin`` fails
(their storage is empty). The manager is one per process (:func:`get_native_pinned_memory`), so every
component sees the same pinned ranges.
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Protocol

import torch

from deepspeed.utils.logging import logger
from ds_ops import op_builder

try:  # private torch API: absent on some versions
    from torch._subclasses.fake_tensor import is_fake as _is_fake
except ImportError:  # pragma: no cover - older torch
    _is_fake = None

BACKEND_ENV = "DS_PIN_MEMORY_BACKEND"
REGISTER_ENV = "DS_PIN_MEMORY_REGISTER_DEVICE"
_BACKENDS = ("torch", "native")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

__all__ = ["BACKEND_ENV", "REGISTER_ENV", "HostRegistrar", "NativePinnedMemory", "get_active_native_pinned_memory",
           "get_native_pinned_memory"]


class HostRegistrar(Protocol):
    """What registers host memory with a device runtime: the accelerator (``register_host_memory`` returns
    whether it registered; ``pin_memory_alignment`` is the address alignment the runtime needs, 1 for none)."""

    def register_host_memory(self, address: int, num_bytes: int) -> bool: ...

    def unregister_host_memory(self, address: int) -> None: ...

    def pin_memory_alignment(self) -> int: ...


def _register_enabled() -> bool:
    value = os.environ.get(REGISTER_ENV, "1").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{REGISTER_ENV}={value!r} is not accepted; use one of {_TRUE + _FALSE}")


def _aligned_down(registrar: HostRegistrar, address: int) -> int:
    alignment = int(registrar.pin_memory_alignment())
    return address - address % alignment if alignment > 1 else address


class NativePinnedMemory:
    """Pins host tensors into page-locked buffers of the ``pin_memory`` op and tracks them.

    ``_ranges`` maps each live buffer's base address to its end (exclusive), so views and slices, which lose
    the ``ds_pinned`` attribute, are still recognised by address.
    """

    def __init__(self) -> None:
        try:
            self._handle = op_builder.PinMemoryBuilder().load().pin_handle()
        except Exception as exc:
            raise RuntimeError(f"{BACKEND_ENV}=native needs the pin_memory op, which could not be loaded: "
                               f"{exc}") from exc
        self._ranges: dict[int, int] = {}
        self._bases: list[int] = []  # sorted keys of _ranges
        self._finalizers: dict[int, weakref.finalize] = {}
        self._registered: dict[int, HostRegistrar] = {}  # base -> who registered it with a device runtime
        # Finalizers run in whichever thread drops the last alias (re-entrantly, at a GC point of this one).
        self._lock = threading.RLock()

    # -- pinning ----------------------------------------------------------------------------------------------
    def pin(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True,
            registrar: HostRegistrar | None = None) -> torch.Tensor:
        """A pinned tensor holding ``tensor``'s values (``make_copy=False``: uninitialised), of its shape
        (``match_shape=False``: flat). ``registrar``: also register the buffer with that device runtime."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"pin: expected a torch.Tensor, got {type(tensor).__name__}")
        shape = tuple(tensor.shape) if match_shape else (tensor.numel(),)
        locked = self._new_locked(tensor, shape, registrar)
        if make_copy:
            locked.copy_(tensor.reshape(shape))
        return locked

    def pin_empty(self, example: torch.Tensor, shape: Sequence[int],
                  registrar: HostRegistrar | None = None) -> torch.Tensor:
        """An uninitialised pinned tensor of ``shape`` with ``example``'s dtype (``example`` may be empty)."""
        return self._new_locked(example, tuple(int(d) for d in shape), registrar)

    def _new_locked(self, example: torch.Tensor, shape: tuple[int, ...],
                    registrar: HostRegistrar | None) -> torch.Tensor:
        numel = 1
        for dim in shape:
            numel *= dim
        # ``root`` owns the allocation; the tensor handed out is a view of it, and so is every view of that,
        # so the finalizer on ``root`` runs only after the last alias is gone.
        root = self._handle.new_cpu_locked_tensor(numel, example)
        begin = root.data_ptr()
        self._register_device(root, registrar)
        with self._lock:
            self._ranges[begin] = begin + root.numel() * root.element_size()
            bisect.insort(self._bases, begin)
            self._finalizers[begin] = weakref.finalize(root, self._release, begin)
        locked = root.view(shape)
        locked.ds_pinned = True
        locked.ds_pin_base = begin  # ZeRO may rebind ``.data``; unpin frees what was pinned, not what is there now
        return locked

    def _register_device(self, root: torch.Tensor, registrar: HostRegistrar | None) -> None:
        if registrar is None or root.numel() == 0 or not _register_enabled():
            return
        if root.is_pinned():  # from the device's own pinned allocator (the op uses it with CUDA): known already
            return
        begin = root.data_ptr()
        start = _aligned_down(registrar, begin)
        try:
            if registrar.register_host_memory(start, root.numel() * root.element_size() + begin - start):
                self._registered[begin] = registrar
        except Exception as exc:  # the buffer is still locked in RAM; only the device's fast path is lost
            logger.warning(f"pin_memory: registering {root.nbytes} pinned bytes with the device failed, the buffer "
                           f"stays mlock-ed only: {exc}")

    # -- queries ----------------------------------------------------------------------------------------------
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (or the buffer it views) was pinned here and is still live."""
        if getattr(tensor, "ds_pinned", False):
            return True
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return False
        if _is_fake is not None and _is_fake(tensor):
            return False
        address = tensor.data_ptr()
        with self._lock:
            i = bisect.bisect_right(self._bases, address) - 1
            return i >= 0 and address < self._ranges[self._bases[i]]

    # -- releasing --------------------------------------------------------------------------------------------
    def unpin(self, tensor: torch.Tensor) -> bool:
        """Free the buffer ``tensor`` was pinned into now; True when one was freed. Its views die with it."""
        begin = getattr(tensor, "ds_pin_base", None)
        if begin is None:
            begin = tensor.data_ptr()
        with self._lock:
            finalizer = self._finalizers.get(begin)
            if finalizer is not None:
                finalizer.detach()
            freed = self._release_locked(begin)
        if hasattr(tensor, "ds_pinned"):
            tensor.ds_pinned = False
        return freed

    def _release(self, begin: int) -> bool:
        with self._lock:
            return self._release_locked(begin)

    def _release_locked(self, begin: int) -> bool:
        registrar = self._registered.get(begin)
        if registrar is not None:
            try:
                registrar.unregister_host_memory(_aligned_down(registrar, begin))
            except Exception as exc:  # never hand pages the device runtime still maps back to malloc
                logger.warning(f"pin_memory: unregistering the buffer at {begin:#x} from the device failed; it is "
                               f"kept allocated: {exc}")
                return False
            del self._registered[begin]
        self._finalizers.pop(begin, None)
        if self._ranges.pop(begin, None) is not None:
            del self._bases[bisect.bisect_left(self._bases, begin)]
        try:
            return self._handle.free_cpu_locked_tensor_by_ptr(begin)
        except Exception:  # interpreter shutdown: the op's module may be gone already
            return False

    def __repr__(self) -> str:
        return f"NativePinnedMemory(live_buffers={len(self._ranges)}, pinned_bytes={self.pinned_bytes()})"

    def pinned_bytes(self) -> int:
        """Bytes held in live pinned buffers."""
        with self._lock:
            return sum(end - begin for begin, end in self._ranges.items())


_shared_native_pins: NativePinnedMemory | None = None  # DeepSpeed's name; tests reset it


def get_native_pinned_memory() -> NativePinnedMemory:
    """The process's manager (made on first use; a RuntimeError when the pin_memory op cannot be loaded)."""
    global _shared_native_pins
    if _shared_native_pins is None:
        _shared_native_pins = NativePinnedMemory()
    return _shared_native_pins


def get_active_native_pinned_memory() -> NativePinnedMemory | None:
    """The manager when ``DS_PIN_MEMORY_BACKEND=native``, None for ``torch`` (the default). Selecting native
    where the op cannot load raises rather than silently pinning through torch."""
    backend = os.environ.get(BACKEND_ENV, "torch").strip().lower()
    if backend not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={backend!r} is not accepted; use one of {_BACKENDS}")
    return get_native_pinned_memory() if backend == "native" else None
