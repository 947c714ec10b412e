"""Crash-safe file writes: temporary name in the same directory, flush + fsync, rename, fsync the directory.

Why: a process killed mid-write (SIGKILL, node loss) must never leave a half-written file under the final
name. ``os.replace`` within one directory is atomic on POSIX; fsyncing the file before the rename and the
directory after it makes the new name durable across a power cut too. ``save_checkpoint`` splits the two halves
(:func:`stage_write` on every rank, agree, then :func:`commit`) so that no rank renames anything until every
rank's writes succeeded.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from typing import BinaryIO

_TMP_MARK = ".tmp-"


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
            try:
                os.remove(os.path.join(head, entry))
            except FileNotFoundError:
                pass


def _open_for_write(path: str) -> BinaryIO:
    """The one place checkpoint bytes are opened for writing (fault-injection tests replace it)."""
    return open(path, "wb")


def discard(tmp: str) -> None:
    """Remove a temporary written by :func:`stage_write` (gone already: nothing to do)."""
    try:
        os.remove(tmp)
    except FileNotFoundError:
        pass


def stage_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> str:
    """Write ``path``'s new content under a temporary sibling name, flushed and fsynced; returns that name.

    Nothing is visible under ``path`` until :func:`commit`; on error the temporary is removed and the error
    (an ``OSError`` keeps its errno: ENOSPC, EACCES, EIO) gets ``checkpoint_path`` = ``path`` for the report.
    """
    path = os.fspath(path)
    remove_stale_temps(path)
    tmp = temp_name(path)
    try:
        with _open_for_write(tmp) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException as exc:
        discard(tmp)
        if isinstance(exc, Exception) and getattr(exc, "checkpoint_path", None) is None:
            try:
                exc.checkpoint_path = path  # type: ignore[attr-defined]
            except AttributeError:  # an exception type with __slots__: the message still says what failed
                pass
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
