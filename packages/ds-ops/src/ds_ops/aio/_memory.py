"""Page-aligned, locked CPU tensors: buffers that O_DIRECT accepts as they are (no bounce copy).

With CUDA, memory comes from torch's pinned (page-locked) host allocator so GPU copies are fast too;
without it, from torch's CPU allocator, over-allocated by one page so the tensor starts on a page boundary,
and ``mlock``-ed so the kernel keeps it resident. Freeing releases the storage at once (like DeepSpeed's
``free_cpu_locked_tensor``); the tensor object is unusable afterwards.
"""

from __future__ import annotations

import threading
import warnings

import torch

from ds_ops.aio import _libaio
from ds_ops.aio._files import PAGE_SIZE

_lock = threading.Lock()
_registry: dict[int, tuple[torch.Tensor, int]] = {}  # data_ptr -> (backing uint8 tensor, locked bytes)
_warned = False


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def aligned_empty(numel: int, dtype: torch.dtype, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor of ``numel`` x ``dtype`` starting on a page boundary, the uint8 tensor that owns the memory)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    span = _round_up(max(nbytes, 1), PAGE_SIZE)
    backing = torch.empty(span + PAGE_SIZE, dtype=torch.uint8, pin_memory=pin)
    start = (-backing.data_ptr()) % PAGE_SIZE
    tensor = backing[start : start + nbytes].view(dtype)
    return tensor, backing


def page_aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``numel`` x ``dtype`` starting on a page boundary, so O_DIRECT moves
    it without a staging copy; plain (not locked) memory, released with the tensor like any other."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"page_aligned_empty: numel must be a non-negative int, got {numel!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"page_aligned_empty: dtype must be a torch.dtype, got {dtype!r}")
    return aligned_empty(numel, dtype)[0]  # the view keeps the backing storage alive


def _resolve_dtype(dtype: torch.dtype | torch.Tensor) -> torch.dtype:
    if isinstance(dtype, torch.Tensor):  # DeepSpeed passes an example tensor
        return dtype.dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    raise TypeError(f"new_cpu_locked_tensor: dtype must be a torch.dtype or an example tensor, got {dtype!r}")


def new_locked(numel: int, dtype: torch.dtype | torch.Tensor) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` elements, page-aligned and locked (pinned where torch can pin)."""
    global _warned
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"new_cpu_locked_tensor: numel must be a non-negative int, got {numel!r}")
    dtype = _resolve_dtype(dtype)
    pin = torch.cuda.is_available()
    tensor, backing = aligned_empty(numel, dtype, pin=pin)
    locked = 0
    if not pin and tensor.numel():
        length = _round_up(tensor.numel() * tensor.element_size(), PAGE_SIZE)
        err = _libaio.mlock(tensor.data_ptr(), length)
        if err == 0:
            locked = length
        elif not _warned:
            _warned = True
            warnings.warn(
                f"new_cpu_locked_tensor: mlock of {length} bytes failed (errno {err}; RLIMIT_MEMLOCK?); "
                "buffers stay page-aligned but are not locked",
                RuntimeWarning,
                stacklevel=3,
            )
    with _lock:
        _registry[tensor.data_ptr()] = (backing, locked)
    return tensor


def is_locked_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` came from :func:`new_locked` and was not freed yet."""
    with _lock:
        return tensor.data_ptr() in _registry


def free_locked(tensor: torch.Tensor) -> None:
    """Unlock and release a tensor from :func:`new_locked`; other tensors are rejected with a ValueError."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"free_cpu_locked_tensor: expected a tensor, got {type(tensor).__name__}")
    with _lock:
        entry = _registry.pop(tensor.data_ptr(), None)
    if entry is None:
        raise ValueError(
            "free_cpu_locked_tensor: this tensor was not made by new_cpu_locked_tensor (or was freed already)"
        )
    backing, locked = entry
    if locked:
        _libaio.munlock(tensor.data_ptr(), locked)
    try:
        backing.untyped_storage().resize_(0)
    except RuntimeError:
        pass  # pinned storage is not resizable: it is released when the last reference goes
