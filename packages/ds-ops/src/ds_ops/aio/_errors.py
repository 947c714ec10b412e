"""The error type of the aio module: an ``OSError`` that names the operation and the path."""

from __future__ import annotations

from typing import Any


class AioError(OSError):
    """An I/O request failed or could not start.

    ``operation`` is the handle method (``sync_pwrite``, ``async_pread``, ...), ``filename`` the path, and
    ``errno`` the system error number when there is one (None for checks made before any I/O, such as a
    read past the end of the file).
    """

    def __init__(self, operation: str, path: str, err: int | None, detail: str) -> None:
        message = f"aio {operation} of {path!r}: {detail}"
        if err is None:
            super().__init__(message)
        else:
            super().__init__(err, message)
        self.operation = operation
        self.path = path
        self.detail = message
        self._given = (operation, path, err, detail)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        # multiprocessing re-raises a worker's error in the parent by unpickling it: rebuild through this
        # __init__ (an unpicklable exception kills the pool's result thread and the parent waits forever)
        return type(self), self._given, dict(self.__dict__)

    def __str__(self) -> str:
        return self.detail
