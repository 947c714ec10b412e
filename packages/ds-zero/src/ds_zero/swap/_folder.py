"""The per-rank swap folder under ``nvme_path`` and the aio handles that move tensors in and out of it.

Layout (DeepSpeed's): ``<nvme_path>/zero_stage_3/<kind>/rank<R>`` with ``kind`` ``optimizer`` or
``params``; each swapper's files go in a ``pid<P>-<N>`` folder inside it, so neither two jobs sharing a disk nor
two engines of one process touch each other's files. The folder is checked (exists, writable) before any
tensor is written, and removed when the swapper is closed, garbage collected, or the interpreter exits.
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import weakref
from typing import Any

from ds_ops.aio import AioError, AsyncIOHandle
from ds_zero.swap._jitter import maybe_jitter

_SWAPPERS = itertools.count()


def _check_root(nvme_path: str, key: str) -> None:
    if not os.path.exists(nvme_path):
        raise AioError("create swap folder", nvme_path, errno.ENOENT,
                       f"{key} does not exist (create it, or point {key} at a mounted NVMe/local disk)")
    if not os.path.isdir(nvme_path):
        raise AioError("create swap folder", nvme_path, errno.ENOTDIR, f"{key} is not a directory")


def make_swap_folder(nvme_path: Any, kind: str, rank: int, key: str) -> str:
    """Create and probe this rank's swap folder; an ``AioError`` naming the path and the operation otherwise."""
    root = os.fspath(nvme_path)
    _check_root(root, key)
    folder = os.path.join(root, "zero_stage_3", kind, f"rank{rank}", f"pid{os.getpid()}-{next(_SWAPPERS)}")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise AioError("create swap folder", folder, exc.errno, f"cannot create the swap folder under {key} "
                       f"({exc.strerror}); it must be writable") from None
    probe = os.path.join(folder, ".probe")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0")
        os.unlink(probe)
    except OSError as exc:
        raise AioError("write probe file", probe, exc.errno, f"the swap folder under {key} is not writable "
                       f"({exc.strerror})") from None
    return folder


def remove_folder(folder: str) -> None:
    """Delete a swap folder and the parents this process created that are left empty."""
    shutil.rmtree(folder, ignore_errors=True)
    parent = os.path.dirname(folder)
    for _ in range(3):  # rank<R>, <kind>, zero_stage_3: only when empty (other ranks/jobs may use them)
        try:
            os.rmdir(parent)
        except OSError:
            return
        parent = os.path.dirname(parent)


def cleanup_on_exit(owner: object, folder: str) -> weakref.finalize:
    """Remove ``folder`` when ``owner`` is collected or at interpreter exit (``finalize()`` does it now)."""
    return weakref.finalize(owner, remove_folder, folder)


def aio_settings(aio: Any) -> dict[str, Any]:
    """The handle arguments of the ``aio`` config section (an object or a dict; None: the defaults).
    ``use_gds`` needs NVIDIA GPUDirect Storage, which this build does not drive: a clear error."""
    if aio is None:
        return {}
    get = aio.get if isinstance(aio, dict) else (lambda k, d=None: getattr(aio, k, d))
    if get("use_gds", False):
        import torch

        why = ("needs NVIDIA GPUDirect Storage (cuFile), which this build does not use"
               + ("" if torch.cuda.is_available() else " and which has no meaning without a CUDA device"))
        from ds_config import ConfigError, ConfigProblem

        raise ConfigError(ConfigProblem("aio.use_gds", f"{why}; accepted: false (the libaio path swaps through CPU "
                                        "buffers)", True))
    out = {k: get(k) for k in ("block_size", "queue_depth", "single_submit", "overlap_events") if get(k) is not None}
    threads = get("thread_count") if get("thread_count") is not None else get("intra_op_parallelism")
    if threads is not None:
        out["thread_count"] = threads
    return {k: (v if isinstance(v, bool) else int(v)) for k, v in out.items()}


def new_handle(aio: Any) -> AsyncIOHandle:
    """An aio handle for a swapper (with the test-only jitter of ``ds_zero.swap._jitter`` when asked for)."""
    return maybe_jitter(AsyncIOHandle(**aio_settings(aio)))


def annotate(exc: AioError, what: str) -> AioError:
    """The same error with the swap operation it broke (``swap in optimizer sub-group 3``) in front."""
    return AioError(f"{what}: {exc.operation}", exc.path, exc.errno, str(exc).split(": ", 1)[-1])


def close_handles(*handles: AsyncIOHandle) -> None:
    """Finish each handle's pending I/O and close it; an I/O error is dropped, as closing follows a failure
    as often as not and the swap files are removed anyway."""
    for h in handles:
        try:
            h.wait()
        except AioError:
            pass
        h.close()
