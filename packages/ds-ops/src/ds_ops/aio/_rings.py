"""Submission/completion rings: a libaio io context, or a small thread pool doing os.preadv/os.pwritev.

Both take a batch of blocks with ``submit`` and hand back ``(block, result)`` pairs from ``reap``, where
result is the number of bytes moved or ``-errno``. A worker thread owns one ring of each kind it uses.
"""

from __future__ import annotations

import errno
import queue
from concurrent.futures import ThreadPoolExecutor

from ds_ops.aio import _libaio
from ds_ops.aio._ops import Block, perform_sync


class LibaioRing:
    """One io context with ``depth`` iocbs. Not thread-safe: used by a single worker thread."""

    kind = "libaio"

    def __init__(self, depth: int) -> None:
        lib = _libaio.libaio()
        if lib is None:
            raise OSError(errno.ENOSYS, _libaio.unavailable_reason() or "libaio unavailable")
        ffi = _libaio.ffi()
        self._ffi, self._lib, self._depth = ffi, lib, depth
        ctx = ffi.new("io_context_t *")
        rc = lib.io_setup(depth, ctx)
        if rc < 0:
            limit = "/proc/sys/fs/aio-max-nr"
            raise OSError(-rc, f"io_setup({depth}) failed: the system-wide limit {limit} may be reached")
        self._ctx = ctx[0]
        self._iocbs = ffi.new("struct iocb[]", depth)
        self._ptrs = ffi.new("struct iocb *[]", depth)
        self._events = ffi.new("struct io_event[]", depth)
        self._free = list(range(depth))
        self._slots: list[Block | None] = [None] * depth
        self._failed: list[tuple[Block, int]] = []

    def submit(self, blocks: list[Block], single: bool) -> None:
        """Queue ``blocks`` to the kernel: one io_submit for the batch, or one per block when ``single``."""
        slots = []
        for i, block in enumerate(blocks):
            slot = self._free.pop()
            slots.append(slot)
            cb = self._iocbs[slot]
            cb.aio_data = slot
            cb.aio_lio_opcode = _libaio.IOCB_CMD_PWRITE if block.write else _libaio.IOCB_CMD_PREAD
            cb.aio_fildes = block.fd
            cb.aio_buf = block.address
            cb.aio_nbytes = block.nbytes
            cb.aio_offset = block.offset
            self._slots[slot] = block
            self._ptrs[i] = self._iocbs + slot
        done, total = 0, len(blocks)
        while done < total:
            count = 1 if single else total - done
            rc = self._lib.io_submit(self._ctx, count, self._ptrs + done)
            if rc == -errno.EINTR:
                continue
            if rc <= 0:
                # The kernel refused the first iocb of the batch; it and those after it never started.
                self._reject(slots[done:], -rc if rc < 0 else errno.EAGAIN)
                return
            done += rc

    def _reject(self, slots: list[int], err: int) -> None:
        for slot in slots:
            block = self._slots[slot]
            self._release(slot)
            self._failed.append((block, -err))

    def _release(self, slot: int) -> None:
        self._slots[slot] = None
        self._free.append(slot)

    def reap(self, min_nr: int) -> list[tuple[Block, int]]:
        """Wait for at least ``min_nr`` completions (rejected submissions count and return at once)."""
        if self._failed:
            out, self._failed = self._failed, []
            return out
        while True:
            n = self._lib.io_getevents(self._ctx, min_nr, self._depth, self._events, self._ffi.NULL)
            if n != -errno.EINTR:
                break
        if n < 0:
            raise OSError(-n, f"io_getevents failed: {errno.errorcode.get(-n, n)}")
        out = []
        for i in range(n):
            event = self._events[i]
            slot = int(event.data)
            out.append((self._slots[slot], int(event.res)))
            self._release(slot)
        return out

    def close(self) -> None:
        """Destroy the io context (the caller has reaped every request first)."""
        if self._ctx is not None:
            self._lib.io_destroy(self._ctx)
            self._ctx = None


class ThreadRing:
    """``depth`` threads doing blocking preadv/pwritev: the fallback without libaio, and buffered I/O."""

    kind = "threads"

    def __init__(self, depth: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="ds-aio-io")
        self._done: queue.SimpleQueue[tuple[Block, int]] = queue.SimpleQueue()

    def submit(self, blocks: list[Block], single: bool) -> None:
        for block in blocks:
            self._pool.submit(self._run, block)

    def _run(self, block: Block) -> None:
        try:
            res = perform_sync(block.fd, block.address, block.nbytes, block.offset, block.write)
        except BaseException:  # never lose a completion: the worker waits for every block it submitted
            res = -errno.EIO
        self._done.put((block, res))

    def reap(self, min_nr: int) -> list[tuple[Block, int]]:
        out = [self._done.get() for _ in range(min_nr)]
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
