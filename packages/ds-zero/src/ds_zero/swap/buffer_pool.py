"""A bounded pool of page-aligned CPU buffers that swapped tensors are read into and written from.

Page-aligned so ``ds_ops.aio`` moves them with O_DIRECT and no bounce copy; locked (pinned under CUDA,
``mlock``-ed otherwise) when ``pin_memory`` asks for it and the system allows. The pool holds ``count``
buffers of ``numel`` elements: what it bounds is the memory the swapping costs, whatever the model size.
"""

from __future__ import annotations

import torch

from ds_ops.aio import free_cpu_locked_tensor, new_cpu_locked_tensor, page_aligned_empty


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

    @property
    def count(self) -> int:
        return len(self._all)

    @property
    def free(self) -> int:
        return len(self._free)

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
        self._free.append(i)

    def reclaim(self) -> None:
        """Every buffer is free again: after a failure, once no I/O uses any of them (the caller waited)."""
        self._free = list(range(len(self._all)))

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self._index

    def close(self) -> None:
        """Release the memory (pinned/locked buffers are unlocked)."""
        if self.pinned:
            for b in self._all:
                free_cpu_locked_tensor(b)
        self._all, self._free, self._index = [], [], {}
