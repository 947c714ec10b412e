"""Crash-safe file writes: temporary name in the same directory, flush + fsync, rename, fsync the directory.

Why: a process killed mid-write (SIGKILL, node loss) must never leave a half-written file under the final
name. ``os.replace`` within one directory is atomic on POSIX; fsyncing the file before the rename and the
directory after it makes the new name durable across a power cut too. ``save_checkpoint`` splits the two halves
(:func:`stage_write` on every rank, agree, then :func:`commit`) so that no rank renames anything until every
rank's writes succeeded.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

_TMP_MARK = ".tmp-"
# Start the disk writes of every this many bytes while the rest of the file is still being serialized, so the
# fsync at the end waits for the tail only (a hint: the fsync alone makes the file durable)
_WRITEBACK_EVERY = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait


def _sync_file_range() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_start_writeback = _sync_file_range()


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the directory's entries (a new or renamed file) durable; a no-op where directories can't be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened; NTFS renames are journaled anyway
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems (network mounts) refuse fsync on directories
        pass
    finally:
        os.close(fd)


def make_dirs(path: str | os.PathLike) -> None:
    """``os.makedirs(exist_ok=True)``, then fsync the parent so the new directory survives a crash."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    os.makedirs(path, exist_ok=True)
    fsync_dir(os.path.dirname(path))


def temp_name(path: str | os.PathLike) -> str:
    """A hidden sibling of ``path`` that no other writer picks: ``.<name>.tmp-<pid>-<random>``."""
    head, name = os.path.split(os.fspath(path))
    return os.path.join(head, f".{name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def remove_stale_temps(path: str | os.PathLike) -> None:
    """Delete temporaries a killed writer of ``path`` left behind (each file has one writer, so this is safe)."""
    head, name = os.path.split(os.fspath(path))
    prefix = f".{name}{_TMP_MARK}"
    try:
        entries = os.listdir(head or ".")
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.startswith(prefix):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(head, entry))


def _open_for_write(path: str) -> BinaryIO:
    """The one place checkpoint bytes are opened for writing (fault-injection tests replace it)."""
    return open(path, "wb")


def discard(tmp: str) -> None:
    """Remove a temporary written by :func:`stage_write` (gone already: nothing to do)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)


class _EarlyWriteback:
    """The file handle a writer sees: every :data:`_WRITEBACK_EVERY` bytes it asks the kernel to start writing what
    came so far (``sync_file_range``), so disk writes overlap serialization instead of all waiting for the fsync."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._started = 0  # bytes whose writeback was started
        self._written = 0
        try:
            self._fd: int | None = handle.fileno() if _start_writeback is not None else None
        except (AttributeError, OSError, ValueError):  # not a real file: nothing to hint
            self._fd = None

    def write(self, data: Any) -> int:
        count = self._handle.write(data)
        self._written += len(data) if count is None else count
        if self._fd is not None and self._written - self._started >= _WRITEBACK_EVERY:
            self._handle.flush()
            _start_writeback(self._fd, self._started, self._written - self._started, _SYNC_FILE_RANGE_WRITE)
            self._started = self._written
        return count

    def __getattr__(self, name: str) -> Any:  # flush, fileno, tell, seek, ... of the real handle
        return getattr(self._handle, name)


def _mark(exc: BaseException, path: str) -> None:
    """Name ``path`` on ``exc`` for the rank's failure report, unless it names a file already."""
    if isinstance(exc, Exception) and getattr(exc, "checkpoint_path", None) is None:
        try:
            exc.checkpoint_path = path  # type: ignore[attr-defined]
        except AttributeError:  # an exception type with __slots__: the message still says what failed
            pass


_FSYNC_WORKERS = 4
_pool: ThreadPoolExecutor | None = None
_pool_pid = -1
_pool_lock = threading.Lock()


def _fsync_pool() -> ThreadPoolExecutor:
    """The process's fsync threads, started once: a pool per save started 4-6 threads each time, and a new thread
    waits to be scheduled (tens of ms on a loaded host). A forked child gets a pool of its own (the parent's threads
    do not exist there)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(_FSYNC_WORKERS, thread_name_prefix="ds-ckpt-fsync")
            _pool_pid = os.getpid()
        return _pool


class Syncer:
    """fsyncs in background threads (``fsync`` releases the GIL), so one file's flush to disk overlaps writing the
    next one; :meth:`wait` returns once every fsync submitted through this syncer is done and raises the first
    failure (naming its file). Used as a context manager, it waits on exit. The threads are the process's shared
    :func:`_fsync_pool`; a syncer waits only for its own fsyncs."""

    def __init__(self) -> None:
        self._pending: list[tuple[Future, str]] = []

    def _submit(self, function: Callable[[], None], path: str) -> None:
        self._pending.append((_fsync_pool().submit(function), path))

    def fsync_file(self, handle: BinaryIO, path: str) -> None:
        """fsync ``handle``'s file (flushed by the caller) in the background; the caller may close ``handle``."""
        fd = os.dup(handle.fileno())

        def run() -> None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        self._submit(run, path)

    def fsync_dir(self, folder: str) -> None:
        self._submit(lambda: fsync_dir(folder), folder)

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for future, path in pending:  # all of them, so no fsync still runs on a file the caller then removes
            exc = future.exception()
            if exc is not None and error is None:
                _mark(exc, path)
                error = exc
        if error is not None:
            raise error

    def __enter__(self) -> Syncer:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.wait()
        else:  # already failing: let the fsyncs finish, keep the first error
            for future, _ in self._pending:
                future.exception()
            self._pending = []


def stage_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], syncer: Syncer | None = None) -> str:
    """Write ``path``'s new content under a temporary sibling name, flushed and fsynced; returns that name.

    With ``syncer`` the fsync runs in its background thread: the file is durable once ``syncer.wait()`` returned.
    Nothing is visible under ``path`` until :func:`commit`; on error the temporary is removed and the error
    (an ``OSError`` keeps its errno: ENOSPC, EACCES, EIO) gets ``checkpoint_path`` = ``path`` for the report.
    """
    path = os.fspath(path)
    remove_stale_temps(path)
    tmp = temp_name(path)
    try:
        with _open_for_write(tmp) as handle:
            write(_EarlyWriteback(handle))
            handle.flush()
            if syncer is None:
                os.fsync(handle.fileno())
            else:
                syncer.fsync_file(handle, path)
    except BaseException as exc:
        discard(tmp)
        _mark(exc, path)
        raise
    return tmp


def commit(tmp: str, path: str | os.PathLike) -> None:
    """Rename a staged temporary onto ``path`` (atomic within a directory); the caller fsyncs the directory."""
    os.replace(tmp, os.fspath(path))


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Create or replace ``path`` with what ``write(file)`` writes, atomically and durably."""
    path = os.fspath(path)
    tmp = stage_write(path, write)
    try:
        commit(tmp, path)
    except BaseException:
        discard(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write` for a small UTF-8 text file (the ``latest`` tag file)."""
    atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))
