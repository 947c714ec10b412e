"""Asynchronous file/NVMe I/O of CPU tensors over Linux libaio: the storage engine of ZeRO-Infinity.

``AsyncIOHandle`` (also ``aio_handle``, DeepSpeed's name) reads and writes whole tensors, splitting each
request into ``block_size`` pieces kept in flight up to ``queue_depth`` per I/O thread, with O_DIRECT when
buffer, offset and block size are aligned (``new_cpu_locked_tensor`` gives such buffers) and buffered I/O
otherwise. ``ds_ops.aio.swap`` moves lists of tensors to a directory and back. Buffers for it:
``new_cpu_locked_tensor``/``free_cpu_locked_tensor`` (page-aligned and locked, as the handle's methods of those
names; one process-wide manager, shared with the ``pin_memory`` op's ``pin_handle``), ``is_pinned``,
``page_aligned_empty`` (page-aligned only).

Why cffi's ABI mode over ``libaio.so.1`` rather than API mode: the calls are few and coarse (one
``io_submit``/``io_getevents`` per batch of >=128 KiB pieces, so libffi's per-call cost is noise next to the
I/O); ABI mode needs neither a C compiler nor libaio's headers on the user's machine, only Debian's runtime
``libaio1`` (``scripts/system-deps.sh`` installs it); there is no build cache to go stale across Python
versions; and the structures passed are the kernel's stable ``iocb``/``io_event`` UAPI, checked by size at load.
Without libaio (or with ``DS_AIO_BACKEND=threads`` / ``backend="threads"``) the same API runs on a thread
pool doing ``os.preadv``/``os.pwritev``, with a warning when it was not asked for.
"""

from ds_ops.aio import pin_memory, swap
from ds_ops.aio._builder import AsyncIOBuilder, PinMemoryBuilder
from ds_ops.aio.async_io import (
    BACKEND_ENV,
    AioError,
    AsyncIOHandle,
    aio_handle,
    deepspeed_memcpy,
    free_cpu_locked_tensor,
    is_locked_tensor,
    is_pinned,
    libaio_unavailable_reason,
    new_cpu_locked_tensor,
    page_aligned_empty,
)

__all__ = [
    "BACKEND_ENV",
    "AioError",
    "AsyncIOBuilder",
    "AsyncIOHandle",
    "PinMemoryBuilder",
    "aio_handle",
    "deepspeed_memcpy",
    "free_cpu_locked_tensor",
    "is_locked_tensor",
    "is_pinned",
    "libaio_unavailable_reason",
    "new_cpu_locked_tensor",
    "page_aligned_empty",
    "pin_memory",
    "swap",
]
