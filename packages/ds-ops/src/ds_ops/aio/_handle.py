"""``AsyncIOHandle``: reads and writes whole CPU tensors to files, synchronously or asynchronously."""

from __future__ import annotations

import os
import threading
import warnings
import weakref

import torch

from ds_ops.aio import _files, _libaio, _memory
from ds_ops.aio._errors import AioError
from ds_ops.aio._ops import Chunk, Op, Target
from ds_ops.aio._rings import LibaioRing
from ds_ops.aio._worker import Settings, Worker

BACKEND_ENV = "DS_AIO_BACKEND"
_BACKENDS = ("auto", "libaio", "threads")
O_DIRECT_ALIGNMENT = 512  # bytes per I/O thread that get_alignment() asks of callers (DeepSpeed's figure)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"AsyncIOHandle: {name} must be a positive int, got {value!r}")
    return value


def _boolean(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"AsyncIOHandle: {name} must be a bool, got {value!r}")
    return value


def _choose_backend(backend: str | None) -> str:
    choice = backend if backend is not None else os.environ.get(BACKEND_ENV, "auto")
    if choice not in _BACKENDS:
        source = "backend" if backend is not None else f"environment variable {BACKEND_ENV}"
        raise ValueError(f"AsyncIOHandle: {source} must be one of {_BACKENDS}, got {choice!r}")
    reason = _libaio.unavailable_reason()
    if choice == "libaio" and reason is not None:
        raise RuntimeError(f"AsyncIOHandle: backend='libaio' requested but {reason}")
    if choice == "auto":
        if reason is None:
            return "libaio"
        warnings.warn(
            f"ds_ops.aio: {reason}; using the thread-pool fallback (os.preadv/os.pwritev)", RuntimeWarning, stacklevel=3
        )
        return "threads"
    return choice


def _stop_workers(workers: list[Worker]) -> None:
    for worker in workers:
        worker.stop()


class AsyncIOHandle:
    """Tensor <-> file I/O over libaio (or a thread pool), the engine under ZeRO-Infinity's NVMe swapping.

    Args (the ``aio`` config section): ``block_size`` bytes per request piece; ``queue_depth`` pieces kept in
    flight per thread; ``single_submit`` submits pieces one by one instead of in batches; ``overlap_events``
    refills the queue as each piece completes instead of waiting for the whole batch; ``thread_count`` I/O
    threads, each with its own io context, that split every request between them (``intra_op_parallelism``
    is accepted as newer DeepSpeed's name for it). ``backend``: "auto"
    (libaio when loadable), "libaio" or "threads" (the fallback); default from ``DS_AIO_BACKEND``.
    ``use_direct``: allow O_DIRECT (used when the file offset and block size are aligned and the filesystem
    accepts it; buffered I/O otherwise). ``stage_unaligned``: a buffer misaligned in memory (plain tensors)
    still gets O_DIRECT through each thread's ``2 * queue_depth`` aligned staging blocks, one copy per
    piece, instead of buffered I/O; page-aligned buffers (``new_cpu_locked_tensor``) are never copied.
    """

    def __init__(
        self,
        block_size: int = 1048576,
        queue_depth: int = 8,
        single_submit: bool = False,
        overlap_events: bool = True,
        thread_count: int = 1,
        *,
        intra_op_parallelism: int | None = None,
        backend: str | None = None,
        use_direct: bool = True,
        stage_unaligned: bool = True,
    ) -> None:
        if intra_op_parallelism is not None:  # newer DeepSpeed's name for thread_count
            if thread_count not in (1, intra_op_parallelism):
                raise ValueError(f"AsyncIOHandle: thread_count={thread_count!r} and intra_op_parallelism="
                                 f"{intra_op_parallelism!r} disagree; give one of them")
            thread_count = intra_op_parallelism
        self._settings = Settings(
            block_size=_positive_int("block_size", block_size),
            queue_depth=_positive_int("queue_depth", queue_depth),
            single_submit=_boolean("single_submit", single_submit),
            overlap_events=_boolean("overlap_events", overlap_events),
        )
        self._thread_count = _positive_int("thread_count", thread_count)
        self._use_direct = _boolean("use_direct", use_direct)
        self._stage_unaligned = _boolean("stage_unaligned", stage_unaligned)
        self._backend = _choose_backend(backend)
        self._workers = self._start_workers(backend is None and os.environ.get(BACKEND_ENV, "auto") == "auto")
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        self._lock = threading.Lock()
        self._pending: list[Op] = []
        self._next_worker = 0
        self._bytes = {"direct": 0, "direct-staged": 0, "buffered": 0}
        self._last_mode: str | None = None

    @classmethod
    def from_config(cls, section: object, **kwargs: object) -> AsyncIOHandle:
        """A handle from the ``aio`` config section (an object with its attributes, or a dict)."""
        names = ("block_size", "queue_depth", "single_submit", "overlap_events", "thread_count")
        if isinstance(section, dict):
            unknown = sorted(set(section) - set(names) - {"use_gds", "intra_op_parallelism"})
            if unknown:
                raise ValueError(f"AsyncIOHandle.from_config: unknown aio keys {unknown}; accepted: {list(names)}")
            if "intra_op_parallelism" in section:
                section = {**section, "thread_count": section["intra_op_parallelism"]}
            values = {k: section[k] for k in names if k in section}
        else:
            values = {k: getattr(section, k) for k in names if hasattr(section, k)}
        return cls(**values, **kwargs)

    def _start_workers(self, may_fall_back: bool) -> list[Worker]:
        """One worker per thread, each with its own io context; in "auto" mode a failed io_setup falls back."""
        workers: list[Worker] = []
        try:
            for i in range(self._thread_count):
                ring = LibaioRing(self._settings.queue_depth) if self._backend == "libaio" else None
                workers.append(Worker(i, self._settings, ring))
        except OSError as exc:
            _stop_workers(workers)
            if not may_fall_back or self._backend != "libaio":
                raise
            warnings.warn(f"ds_ops.aio: {exc}; using the thread-pool fallback", RuntimeWarning, stacklevel=3)
            self._backend = "threads"
            return self._start_workers(False)
        except BaseException:
            _stop_workers(workers)
            raise
        return workers

    # -- settings ---------------------------------------------------------------------------------------
    def get_block_size(self) -> int:
        return self._settings.block_size

    def get_queue_depth(self) -> int:
        return self._settings.queue_depth

    def get_single_submit(self) -> bool:
        return self._settings.single_submit

    def get_overlap_events(self) -> bool:
        return self._settings.overlap_events

    def get_thread_count(self) -> int:
        return self._thread_count

    get_intra_op_parallelism = get_thread_count

    def get_backend(self) -> str:
        """"libaio" or "threads" (the fallback)."""
        return self._backend

    def get_last_io_mode(self) -> str | None:
        """"direct" (O_DIRECT), "direct-staged" (O_DIRECT through staging blocks) or "buffered" for the
        most recent request; None before any."""
        return self._last_mode

    def io_mode_bytes(self) -> dict[str, int]:
        """Bytes requested so far per mode: "direct", "direct-staged" and "buffered" (page cache)."""
        with self._lock:
            return dict(self._bytes)

    # -- I/O --------------------------------------------------------------------------------------------
    # DeepSpeed's parameter names (buffer, filename, file_offset), so keyword calls written for its handle work.
    # ``fd=`` (or an int in ``filename``'s place, as DeepSpeed's async_pwrite overload takes it) names an open
    # descriptor instead of a path: the I/O goes to the file it points at, in place at ``file_offset``, through
    # descriptors of the handle's own (see ``_files.open_descriptor``); the caller's stays open and theirs.
    def sync_pread(self, buffer: torch.Tensor, filename: str | os.PathLike | int | None = None,
                   file_offset: int = 0, *, fd: int | None = None) -> int:
        """Fill ``buffer`` with ``buffer.nbytes`` bytes of ``filename`` (or open ``fd``) from byte ``file_offset``;
        returns 1."""
        return self._run(self._submit("sync_pread", buffer, (filename, fd), file_offset, write=False))

    def sync_pwrite(
        self,
        buffer: torch.Tensor,
        filename: str | os.PathLike | int | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
        whole_file: bool | None = None,
        fsync: bool = False,
    ) -> int:
        """Write ``buffer``'s bytes to ``filename`` (or open ``fd``) at ``file_offset``; returns 1 (ops done).

        ``whole_file`` (default: ``file_offset == 0`` for a path) writes a temporary file renamed over ``filename``
        once complete, so it afterwards holds exactly the tensor and is never seen half-written; otherwise the
        bytes are written in place (the file is created if missing; always so for ``fd``). ``fsync`` flushes
        before the rename (before the request completes, for ``fd``).
        """
        return self._run(self._submit("sync_pwrite", buffer, (filename, fd), file_offset, True, whole_file, fsync))

    def async_pread(self, buffer: torch.Tensor, filename: str | os.PathLike | int | None = None,
                    file_offset: int = 0, *, fd: int | None = None) -> int:
        """Start reading into ``buffer``; returns 0 at once. ``wait()`` completes it. Errors known up front raise."""
        self._queue(self._submit("async_pread", buffer, (filename, fd), file_offset, write=False))
        return 0

    def async_pwrite(
        self,
        buffer: torch.Tensor,
        filename: str | os.PathLike | int | None = None,
        file_offset: int = 0,
        *,
        fd: int | None = None,
        whole_file: bool | None = None,
        fsync: bool = False,
    ) -> int:
        """Start writing ``buffer`` (see ``sync_pwrite``); returns 0 at once. Do not modify it before ``wait()``;
        an ``fd`` must stay open until the call returns (the handle holds its own descriptors afterwards)."""
        self._queue(self._submit("async_pwrite", buffer, (filename, fd), file_offset, True, whole_file, fsync))
        return 0

    def wait(self) -> int:
        """Wait for every async request; return how many completed, or raise the first failure (in call order)."""
        with self._lock:
            ops, self._pending = self._pending, []
        first: BaseException | None = None
        for op in ops:
            op.done.wait()
            if op.error is not None and first is None:
                first = op.error
        if first is not None:
            raise first
        return len(ops)

    def pending(self) -> int:
        """Async requests started and not yet collected by ``wait()``."""
        with self._lock:
            return len(self._pending)

    # -- DeepSpeed's other entry points ---------------------------------------------------------------------
    def read(self, tensor: torch.Tensor, path: str | os.PathLike, validate: bool = False) -> int:
        return self.pread(tensor, path, validate, False)

    def write(self, tensor: torch.Tensor, path: str | os.PathLike, validate: bool = False) -> int:
        return self.pwrite(tensor, path, validate, False)

    def pread(self, tensor, path, validate: bool = False, async_op: bool = False, file_offset: int = 0) -> int:
        """DeepSpeed's ``pread(buffer, filename, validate, async, file_offset)``; ``validate`` re-reads and compares."""
        if async_op:
            return self.async_pread(tensor, path, file_offset)
        done = self.sync_pread(tensor, path, file_offset)
        if validate:
            self._validate("pread", tensor, path, file_offset)
        return done

    def pwrite(self, tensor, path, validate: bool = False, async_op: bool = False, file_offset: int = 0) -> int:
        """DeepSpeed's ``pwrite(buffer, filename, validate, async, file_offset)``."""
        if async_op:
            return self.async_pwrite(tensor, path, file_offset)
        done = self.sync_pwrite(tensor, path, file_offset)
        if validate:
            self._validate("pwrite", tensor, path, file_offset)
        return done

    def _validate(self, operation: str, tensor: torch.Tensor, path, offset: int) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if isinstance(path, int):  # a caller's descriptor: read it without taking it over (open() would close it)
            on_disk = os.pread(path, nbytes, offset)
        else:
            with open(path, "rb") as f:
                f.seek(offset)
                on_disk = f.read(nbytes)
        if on_disk != _memory_bytes(tensor):
            raise AioError(operation, os.fspath(path), None, "validation failed: file bytes differ from the tensor")

    def get_alignment(self) -> int:
        """Bytes that request sizes and file offsets should be multiples of to go fully direct:
        ``512 * thread_count``, DeepSpeed's figure (writers such as ``deepspeed.io.FastFileWriter`` size their
        buffers by it). Other sizes work too: the unaligned part goes through the page cache."""
        return O_DIRECT_ALIGNMENT * self._thread_count

    # -- buffers ------------------------------------------------------------------------------------------
    def new_cpu_locked_tensor(self, numel: int, dtype: torch.dtype | torch.Tensor) -> torch.Tensor:
        """A page-aligned, locked (pinned with CUDA) 1-D tensor: direct I/O uses it without a bounce copy.
        Process-wide: any handle (and the ``pin_memory`` op's ``pin_handle``) recognises and frees it."""
        return _memory.new_locked(numel, dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Release a tensor from ``new_cpu_locked_tensor`` now: True, or False (nothing done) for a tensor that
        does not start a live locked buffer, as DeepSpeed's handle answers."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"free_cpu_locked_tensor: expected a tensor, got {type(tensor).__name__}")
        return _memory.release(tensor.data_ptr())

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` needs no bounce copy: torch-pinned, or inside a locked buffer (views count)."""
        return _memory.is_pinned(buffer)

    # -- lifetime -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish queued requests and release the I/O threads and io contexts. Pending errors stay for wait()."""
        self._finalizer()

    def __enter__(self) -> AsyncIOHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self._settings
        return (
            f"AsyncIOHandle(block_size={s.block_size}, queue_depth={s.queue_depth}, "
            f"single_submit={s.single_submit}, overlap_events={s.overlap_events}, "
            f"thread_count={self._thread_count}, backend={self._backend!r})"
        )

    # -- internals ----------------------------------------------------------------------------------------
    def _submit(self, operation, tensor, where, offset, write, whole_file=None, fsync=False) -> Op:
        if not self._finalizer.alive:
            raise RuntimeError(f"aio {operation}: the handle is closed")
        path, fd = _check_where(operation, *where)
        _check_tensor(operation, path, tensor)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"aio {operation} of {path!r}: offset must be a non-negative int, got {offset!r}")
        if whole_file is None:
            whole_file = offset == 0 and fd is None
        if write and whole_file and fd is not None:
            raise ValueError(f"aio {operation} of {path!r}: whole_file=True needs a path (a temporary file is renamed "
                             f"over it), got fd={fd}")
        if write and whole_file and offset != 0:
            raise ValueError(f"aio {operation} of {path!r}: whole_file=True needs offset 0, got {offset}")
        nbytes = tensor.numel() * tensor.element_size()
        req = _files.Request(operation, path, tensor.data_ptr(), nbytes, offset, self._settings.block_size,
                             self._use_direct, self._stage_unaligned)
        if fd is not None:
            target = _files.open_descriptor(req, fd, write, fsync)
        else:
            target = _files.open_write(req, whole_file, fsync) if write else _files.open_read(req)
        op = Op(operation, write, tensor, req.address, nbytes, offset, target)
        self._dispatch(op)
        return op

    def _dispatch(self, op: Op) -> None:
        target: Target = op.target
        with self._lock:
            self._bytes[target.mode] += op.nbytes
            self._last_mode = target.mode
            first = self._next_worker
            self._next_worker = (first + 1) % self._thread_count
        ring_kind = "libaio" if self._backend == "libaio" and target.mode != "buffered" else "threads"
        bounds = _split(op.nbytes, self._settings.block_size, self._thread_count)
        op.chunks_left = len(bounds)
        if not bounds:
            op.chunks_left = 1
            op.chunk_done()
            return
        for i, (start, end) in enumerate(bounds):
            self._workers[(first + i) % self._thread_count].jobs.put(Chunk(op, start, end, ring_kind))

    def _queue(self, op: Op) -> None:
        with self._lock:
            self._pending.append(op)

    @staticmethod
    def _run(op: Op) -> int:
        op.done.wait()
        if op.error is not None:
            raise op.error
        return 1


def _split(nbytes: int, block_size: int, parts: int) -> list[tuple[int, int]]:
    """Cut ``[0, nbytes)`` into at most ``parts`` contiguous ranges whose inner edges are block multiples."""
    if nbytes == 0:
        return []
    blocks = -(-nbytes // block_size)
    per = -(-blocks // parts) * block_size
    return [(start, min(start + per, nbytes)) for start in range(0, nbytes, per)]


def _check_where(operation: str, filename: object, fd: object) -> tuple[str, int | None]:
    """(name for messages, descriptor or None) from a call's ``filename`` / ``fd`` (exactly one of them)."""
    if isinstance(filename, int) and not isinstance(filename, bool):  # DeepSpeed's async_pwrite(buffer, fd, ..)
        filename, fd = (None, filename) if fd is None else (filename, fd)
    if (filename is None) == (fd is None):
        raise TypeError(f"aio {operation}: give exactly one of filename= (a path) and fd= (an open descriptor), "
                        f"got filename={filename!r}, fd={fd!r}")
    if fd is None:
        return _check_path(operation, filename), None
    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
        raise ValueError(f"aio {operation}: fd must be a non-negative int (an open file descriptor), got {fd!r}")
    return _files.descriptor_name(fd), fd


def _check_path(operation: str, path: object) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"aio {operation}: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path:
        raise ValueError(f"aio {operation}: path is empty")
    return path


def _check_tensor(operation: str, path: str, tensor: object) -> None:
    where = f"aio {operation} of {path!r}"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{where}: the tensor is on {tensor.device}; only CPU tensors are supported (copy it first)")
    if tensor.layout != torch.strided:
        raise ValueError(f"{where}: the tensor layout {tensor.layout} is not supported (strided only)")
    if not tensor.is_contiguous():
        raise ValueError(f"{where}: the tensor is not contiguous (strides {tuple(tensor.stride())}); use .contiguous()")
    needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    if tensor.numel() and tensor.untyped_storage().nbytes() < needed:
        raise ValueError(f"{where}: the tensor's storage was released (free_cpu_locked_tensor?)")


def _memory_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
