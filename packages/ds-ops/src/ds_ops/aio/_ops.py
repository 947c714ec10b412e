"""One read or write request (``Op``), its per-thread slices (``Chunk``) and their block pieces (``Block``).

An op is split into at most ``thread_count`` contiguous chunks on block-size boundaries; each worker thread
cuts its chunk into ``block_size`` blocks and keeps up to ``queue_depth`` of them in flight. The op is
finished (files closed, temporary file renamed or removed) by whichever worker completes its last chunk.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_ops.aio import _libaio
from ds_ops.aio._errors import AioError

_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Target:
    """The open files of one op. ``direct_end``: bytes (from the op's start) served through ``direct_fd``."""

    path: str
    fd: int
    direct_fd: int = -1
    direct_end: int = 0
    temp_path: str | None = None
    fsync: bool = False
    staged: bool = False  # direct I/O of a misaligned buffer through the worker's aligned staging blocks

    @property
    def mode(self) -> str:
        if self.direct_fd < 0:
            return "buffered"
        return "direct-staged" if self.staged else "direct"

    def close(self) -> None:
        for fd in (self.direct_fd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1


@dataclass(eq=False)
class Op:
    """A request on one file. ``address`` is the tensor's data pointer; ``tensor`` keeps it alive."""

    operation: str
    write: bool
    tensor: Any
    address: int
    nbytes: int
    offset: int
    target: Target
    chunks_left: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = exc

    def chunk_done(self) -> None:
        with self._lock:
            self.chunks_left -= 1
            last = self.chunks_left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        target = self.target
        try:
            if self.error is None and target.fsync:
                os.fsync(target.fd)
            target.close()
            if target.temp_path is not None:
                if self.error is None:
                    os.replace(target.temp_path, target.path)
                else:
                    os.unlink(target.temp_path)
        except OSError as exc:
            self.fail(AioError(self.operation, target.path, exc.errno, f"finishing the write failed: {exc.strerror}"))
            _remove_quietly(target.temp_path)
        finally:
            target.close()
            self.tensor = None
            self.done.set()

    def block_error(self, file_offset: int, err: int | None, detail: str) -> AioError:
        where = f"at file offset {file_offset}"
        if err is not None:
            return AioError(self.operation, self.target.path, err, f"{where}: {os.strerror(err)}{detail}")
        return AioError(self.operation, self.target.path, None, f"{where}: {detail}")


def _remove_quietly(path: str | None) -> None:
    if path is None:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Chunk:
    """Bytes ``[start, end)`` of an op, served by one worker; ``cursor`` is the next byte to hand out."""

    __slots__ = ("op", "start", "end", "cursor", "inflight", "ring_kind")

    def __init__(self, op: Op, start: int, end: int, ring_kind: str) -> None:
        self.op, self.start, self.end, self.cursor = op, start, end, start
        self.inflight = 0
        self.ring_kind = ring_kind

    def next_block(self, block_size: int, staging: Callable[[], Staging]) -> Block | None:
        """The next piece (or None when all were handed out). Pieces never straddle the direct/buffered edge."""
        if self.cursor >= self.end:
            return None
        op, start = self.op, self.cursor
        stop = min(start + block_size, self.end)
        target = op.target
        direct = target.direct_fd >= 0 and start < target.direct_end
        if direct:
            stop = min(stop, target.direct_end)
        self.cursor = stop
        self.inflight += 1
        fd = target.direct_fd if direct else target.fd
        block = Block(self, fd, op.address + start, stop - start, op.offset + start)
        if direct and target.staged:
            block.stage = staging().take(block)
        return block

    def abandon(self) -> None:
        """Stop handing out blocks after an error; in-flight ones still complete."""
        self.cursor = self.end

    @property
    def finished(self) -> bool:
        return self.cursor >= self.end and self.inflight == 0


class Block:
    """One I/O piece: ``nbytes`` at memory ``address`` to/from file ``offset`` through ``fd``.

    A staged block does its I/O on an aligned staging slot (``stage``) whose ``address`` replaced the
    tensor's (``user_address``): filled before a write, copied out after a read.
    """

    __slots__ = ("chunk", "fd", "address", "nbytes", "offset", "user_address", "stage")

    def __init__(self, chunk: Chunk, fd: int, address: int, nbytes: int, offset: int) -> None:
        self.chunk, self.fd, self.address, self.nbytes, self.offset = chunk, fd, address, nbytes, offset
        self.user_address, self.stage = address, None

    @property
    def write(self) -> bool:
        return self.chunk.op.write


def perform_sync(fd: int, address: int, nbytes: int, offset: int, write: bool) -> int:
    """Blocking pread/pwrite of one piece (the GIL is released inside); bytes moved or ``-errno``."""
    ffi = _libaio.ffi()
    buf = ffi.buffer(ffi.cast("char *", address), nbytes)
    try:
        if write:
            return os.pwritev(fd, [buf], offset)
        return os.preadv(fd, [buf], offset)
    except OSError as exc:
        return -(exc.errno or errno.EIO)


class Staging:
    """``slots`` page-aligned blocks of ``block_size`` bytes owned by one worker."""

    def __init__(self, slots: int, block_size: int) -> None:
        span = slots * block_size + _PAGE
        self._memory = torch.empty(span, dtype=torch.uint8)
        self._base = self._memory.data_ptr() + (-self._memory.data_ptr()) % _PAGE
        self._block_size = block_size
        self._free = list(range(slots))

    def take(self, block: Block) -> int:
        """Point ``block`` at a free slot (filled from the tensor for a write); return the slot."""
        slot = self._free.pop()
        block.address = self._base + slot * self._block_size
        if block.write:
            _libaio.memcpy(block.address, block.user_address, block.nbytes)
        return slot

    def give_back(self, block: Block, ok: bool) -> None:
        """Copy a read slot out to the tensor (when it succeeded) and free the slot."""
        if ok and not block.write:
            _libaio.memcpy(block.user_address, block.address, block.nbytes)
        self._free.append(block.stage)
        block.stage = None


def complete_block(block: Block, res: int) -> bool:
    """Account one finished piece: record errors, finish short transfers synchronously (buffered fd).

    Returns whether the piece succeeded; a staged piece's slot is handed back by the worker afterwards.
    """
    chunk, op = block.chunk, block.chunk.op
    chunk.inflight -= 1
    if res < 0:
        op.fail(op.block_error(block.offset, -res, ""))
        chunk.abandon()
        return False
    done = res
    while done < block.nbytes:
        # Short transfers are rare (signals, end of a reservation): finish the rest on the buffered fd,
        # which accepts any alignment.
        more = perform_sync(op.target.fd, block.address + done, block.nbytes - done, block.offset + done, op.write)
        if more < 0:
            op.fail(op.block_error(block.offset + done, -more, ""))
            chunk.abandon()
            return False
        if more == 0:
            what = "the file ended early" if not op.write else "the device accepted no more bytes"
            op.fail(op.block_error(block.offset + done, None, what))
            chunk.abandon()
            return False
        done += more
    return True
