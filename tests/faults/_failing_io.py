"""Make this process's writes to some files fail with an errno, as a full or read-only disk would.

``EACCES`` fails the open for writing (permission denied creating the file); ``ENOSPC`` lets the open succeed
and fails the first write (a full disk) for Python-level files (``open``), and fails the open for the
descriptor-level opens (``os.open``: the NVMe swap path), where the write itself may happen in native code.
Only paths whose base name contains ``match`` (temporary siblings included) under ``folder`` are affected.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
from collections.abc import Iterator


class _FullDiskFile:
    """A file object whose writes fail with ENOSPC; everything else goes to the real file."""

    def __init__(self, real, path: str) -> None:
        self._real, self._path = real, path

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._path)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._real.close()

    def __getattr__(self, name: str):
        return getattr(self._real, name)


@contextlib.contextmanager
def failing_writes(folder: str, match: str, err: int) -> Iterator[list[str]]:
    """Within the block, writes under ``folder`` to files named like ``match`` fail with ``err``; yields the
    paths that failed."""
    folder = os.path.abspath(folder)
    failed: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def hit(path, writing: bool) -> bool:
        if not writing or not isinstance(path, (str, os.PathLike)):
            return False
        full = os.path.abspath(os.fspath(path))
        return full.startswith(folder + os.sep) and match in os.path.basename(full)

    def fake_open(file, mode="r", *args, **kwargs):
        if hit(file, any(c in mode for c in "wax+")):
            failed.append(os.fspath(file))
            if err != errno.ENOSPC:
                raise OSError(err, os.strerror(err), os.fspath(file))
            return _FullDiskFile(real_open(file, mode, *args, **kwargs), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path, flags, *args, **kwargs):
        if hit(path, bool(flags & (os.O_WRONLY | os.O_RDWR))):
            failed.append(os.fspath(path))
            raise OSError(err, os.strerror(err), os.fspath(path))
        return real_os_open(path, flags, *args, **kwargs)

    builtins.open, os.open = fake_open, fake_os_open
    try:
        yield failed
    finally:
        builtins.open, os.open = real_open, real_os_open
