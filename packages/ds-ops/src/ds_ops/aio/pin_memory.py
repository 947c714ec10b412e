"""The ``pin_memory`` op module: what ``PinMemoryBuilder().load()`` returns, as DeepSpeed's builder returns its
compiled ``pin_memory`` extension. ``pin_handle`` allocates page-locked (``mlock``-ed, or CUDA-pinned) CPU
tensors without any of the async-I/O machinery.

Its buffers live in the same process-wide manager as ``aio_handle``'s (``ds_ops.aio._memory``): a buffer made
by either handle is recognised and freed by the other, whichever instance is asked.
"""

from __future__ import annotations

import torch

from ds_ops.aio import _memory


def _check_example(example_tensor: object) -> torch.Tensor:
    if not isinstance(example_tensor, torch.Tensor):
        raise TypeError(f"pin_handle.new_cpu_locked_tensor: example_tensor must be a torch.Tensor (it gives the "
                        f"dtype), got {type(example_tensor).__name__}")
    return example_tensor


class pin_handle:  # noqa: N801 - DeepSpeed's name for the op's handle type
    """Page-locked CPU buffers: ``new_cpu_locked_tensor(num_elem, example_tensor)`` (1-D, ``example_tensor``'s
    dtype, page-aligned), ``free_cpu_locked_tensor(tensor)`` / ``free_cpu_locked_tensor_by_ptr(address)``
    (True when a live buffer was freed, False otherwise) and ``is_pinned(buffer)`` (torch-pinned, or inside
    a locked buffer: views and slices count)."""

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        return _memory.new_locked(num_elem, _check_example(example_tensor).dtype)

    def free_cpu_locked_tensor(self, locked_tensor: torch.Tensor) -> bool:
        if not isinstance(locked_tensor, torch.Tensor):
            raise TypeError(f"pin_handle.free_cpu_locked_tensor: expected a tensor, got "
                            f"{type(locked_tensor).__name__}")
        return _memory.release(locked_tensor.data_ptr())

    def free_cpu_locked_tensor_by_ptr(self, address: int) -> bool:
        if isinstance(address, bool) or not isinstance(address, int) or address < 0:
            raise TypeError(f"pin_handle.free_cpu_locked_tensor_by_ptr: address must be a non-negative int, "
                            f"got {address!r}")
        return _memory.release(address)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        return _memory.is_pinned(buffer)

    def __repr__(self) -> str:
        return f"pin_handle(live_buffers={_memory.live_buffers()})"


__all__ = ["pin_handle"]
