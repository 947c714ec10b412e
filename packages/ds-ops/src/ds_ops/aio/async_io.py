"""The ``async_io`` op module: what ``AsyncIOBuilder().load()`` returns, as DeepSpeed's builder returns its compiled
``async_io`` extension. ``aio_handle`` is the handle type; the buffer helpers and the backend switch come with it.

``ds_ops.aio`` serves these same objects, plus ``swap`` and the builder. They live here, below both the package and
the builder, so that the builder can hand out the op without importing the package that imports the builder.
"""

from ds_ops.aio._errors import AioError
from ds_ops.aio._handle import BACKEND_ENV, AsyncIOHandle
from ds_ops.aio._libaio import unavailable_reason as libaio_unavailable_reason
from ds_ops.aio._memory import free_locked as free_cpu_locked_tensor
from ds_ops.aio._memory import is_locked_tensor, is_pinned, page_aligned_empty
from ds_ops.aio._memory import memcpy as deepspeed_memcpy
from ds_ops.aio._memory import new_locked as new_cpu_locked_tensor

aio_handle = AsyncIOHandle

__all__ = [
    "BACKEND_ENV",
    "AioError",
    "AsyncIOHandle",
    "aio_handle",
    "deepspeed_memcpy",
    "free_cpu_locked_tensor",
    "is_locked_tensor",
    "is_pinned",
    "libaio_unavailable_reason",
    "new_cpu_locked_tensor",
    "page_aligned_empty",
]
