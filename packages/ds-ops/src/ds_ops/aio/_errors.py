"""The error type of the aio module: an ``OSError`` that names the operation and the path."""

from __future__ import annotations


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

    def __str__(self) -> str:
        return self.detail
