"""An inter-process file lock (flock) so ranks that build the same op at once wait for one build.

The kernel drops a flock when its holder dies, so a crashed build never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path


class LockTimeout(TimeoutError):
    """Another process held the lock for longer than the caller wanted to wait."""


@contextlib.contextmanager
def file_lock(path: Path, timeout_s: float = 900.0, poll_s: float = 0.05) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if missing) for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LockTimeout(
                        f"waited {timeout_s:.0f} s for the build lock {path}; another process is still building. "
                        "If no build is running, delete that file."
                    ) from None
                time.sleep(poll_s)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
