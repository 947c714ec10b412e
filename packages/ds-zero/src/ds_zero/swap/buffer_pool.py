"""A bounded pool of page-aligned CPU buffers that swapped tensors are read into and written from.

Page-aligned so ``ds_ops.aio`` moves them with O_DIRECT and no bounce copy; locked (pinned under CUDA,
``mlock``-ed otherwise) when ``pin_memory`` asks for it and the system allows. The pool holds ``count``
buffers of ``numel`` elements: what it bounds is the memory the swapping costs, whatever the model size.

Ownership rule (enforced: breaking it raises :class:`BufferInFlightError` naming the buffer and the transfer)
-----------------------------------------------------------------------------------------------------------
Each buffer is at any time in exactly one of three states:

- **free**: in the pool. Nobody holds it; ``get``/``get_many`` hand out only free buffers.
- **owned**: handed out by ``get``/``get_many`` and not yet ``put`` back. Its holder (one swapper, for one
  sub-group or one parameter partition) alone may read it, write it, start a transfer on it, or ``put`` it.
- **in flight**: its holder started an asynchronous read into it or write from it (``begin(tensor,
  handle)``, where ``tensor`` is the buffer or a view of it) and has not yet waited for ``handle``. Until
  then its bytes are undefined (a read may land at any moment) or still being sent (a write), so *nobody*
  may read it (``check_ready``), start another transfer on it (``begin``), or give it back (``put``).
  ``settle(handle)``, called right after ``handle.wait()`` returned or raised (the wait covers every
  request of that handle), makes every buffer in flight on ``handle`` owned again.

So a buffer goes free -> owned -> (in flight -> owned)* -> free, and the only way out of "in flight" is the
wait on the very handle the transfer was started on. ``reclaim`` (after a failure, once the caller waited for
every handle) makes every buffer free at once.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from ds_ops.aio import free_cpu_locked_tensor, new_cpu_locked_tensor, page_aligned_empty


class BufferInFlightError(RuntimeError):
    """A pool buffer was used, reused or given back while an asynchronous transfer on it was not waited for."""


class BufferPool:
    """``count`` buffers of ``numel`` x ``dtype``; ``get()`` hands one out (None when all are out), ``put()``
    takes it back. ``key`` names the config option that sized the pool, for error messages."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype, pin_memory: bool = False,
                 key: str = "buffer_count") -> None:
        if count < 1:
            raise ValueError(f"{key}={count}: the swap buffer pool needs at least 1 buffer")
        self.numel, self.dtype, self.key, self.pinned = numel, dtype, key, pin_memory
        self._all = [new_cpu_locked_tensor(numel, dtype) if pin_memory else page_aligned_empty(numel, dtype)
                     for _ in range(count)]
        self._free = list(range(count))
        self._index = {b.data_ptr(): i for i, b in enumerate(self._all)}
        self._starts = sorted(self._index)  # buffer start addresses, to find the buffer a view lies in
        self._span = numel * torch.empty(0, dtype=dtype).element_size()
        self._flight: dict[int, tuple[str, Any]] = {}  # buffer -> (what is in flight, the handle to wait)

    @property
    def count(self) -> int:
        return len(self._all)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_flight(self) -> int:
        """Buffers with a transfer not yet waited for."""
        return len(self._flight)

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool (the memory cost of swapping)."""
        return sum(b.numel() * b.element_size() for b in self._all)

    def get(self) -> torch.Tensor | None:
        """A whole free buffer, or None when every buffer is in use."""
        return self._all[self._free.pop()] if self._free else None

    def get_many(self, n: int) -> list[torch.Tensor] | None:
        """``n`` buffers at once, or None (and none taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._all[self._free.pop()] for _ in range(n)]

    def put(self, buffer: torch.Tensor) -> None:
        i = self._index.get(buffer.data_ptr())
        if i is None or i in self._free:
            raise ValueError("BufferPool.put: this tensor is not a buffer of the pool that is out")
        self._refuse_in_flight(i, "give back")
        self._free.append(i)

    def reclaim(self) -> None:
        """Every buffer is free again: after a failure, once no I/O uses any of them (the caller waited)."""
        self._free = list(range(len(self._all)))
        self._flight.clear()

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self._index

    # ---- the ownership rule (module docstring) -----------------------------------------------------------
    def _which(self, tensor: torch.Tensor) -> int | None:
        """The buffer ``tensor`` (a buffer or a view of one) lies in, or None for memory outside the pool."""
        if not self._starts or tensor.device.type != "cpu":
            return None
        at = tensor.data_ptr()
        k = bisect.bisect_right(self._starts, at) - 1
        if k < 0 or at >= self._starts[k] + self._span:
            return None
        return self._index[self._starts[k]]

    def _refuse_in_flight(self, i: int, doing: str) -> None:
        flight = self._flight.get(i)
        if flight is not None:
            raise BufferInFlightError(
                f"swap buffer {i} of {self.key}'s pool: cannot {doing} it while its {flight[0]} is in flight; "
                "the transfer is over only once its aio handle's wait() returned (then settle() the handle)")

    def begin(self, tensor: torch.Tensor, handle: Any, what: str) -> None:
        """An asynchronous transfer (``what``: "read of <file>" / "write of <file>") on ``tensor`` starts on
        ``handle``: its buffer is in flight until :meth:`settle` of that handle. Memory outside the pool (a
        new state tensor, a temporary buffer) is not tracked: the request itself keeps it alive."""
        i = self._which(tensor)
        if i is None:
            return
        if i in self._free:
            raise BufferInFlightError(f"swap buffer {i} of {self.key}'s pool: a {what} on a buffer that is in "
                                      "the pool (not handed out, or already given back)")
        self._refuse_in_flight(i, f"start a {what} on")
        self._flight[i] = (what, handle)

    def abort(self, tensor: torch.Tensor) -> None:
        """The transfer :meth:`begin` announced for ``tensor`` was refused when submitted: nothing is in flight."""
        i = self._which(tensor)
        if i is not None:
            self._flight.pop(i, None)

    def settle(self, handle: Any) -> None:
        """``handle.wait()`` returned (or raised): none of its transfers is in flight any more."""
        for i in [i for i, (_, h) in self._flight.items() if h is handle]:
            del self._flight[i]

    def check_ready(self, tensors: Any) -> None:
        """Raise unless every tensor of ``tensors`` (an iterable) is outside the pool or in an owned buffer with
        no transfer in flight: what a swapper checks before it lets anyone read or change them."""
        for t in tensors:
            i = self._which(t)
            if i is None:
                continue
            if i in self._free:
                raise BufferInFlightError(f"swap buffer {i} of {self.key}'s pool: used after it was given back")
            self._refuse_in_flight(i, "use")

    def close(self) -> None:
        """Release the memory (pinned/locked buffers are unlocked)."""
        if self.pinned:
            for b in self._all:
                free_cpu_locked_tensor(b)
        self._all, self._free, self._index, self._starts, self._flight = [], [], {}, [], {}
