"""``PyFileWriter``: a plain Python file under the writer interface (the baseline the fast writer is measured
against), counting writes, bytes and seconds."""

from __future__ import annotations

import time

from deepspeed.io.base_file_writer import BaseFileWriter
from deepspeed.io.constants import (
    CLOSE_COUNT_KEY,
    FILENO_COUNT_KEY,
    FLUSH_COUNT_KEY,
    INVALID_FD,
    WRITE_BYTES_KEY,
    WRITE_COUNT_KEY,
    WRITE_SEC_KEY,
)


class PyFileWriter(BaseFileWriter):
    def __init__(self, file_path: str) -> None:
        super().__init__(file_path)
        self._fp = open(self._file_path, "wb")  # noqa: SIM115 - held until close(), as a file object is

    def close(self) -> None:
        self._incr_stats(CLOSE_COUNT_KEY)
        self._fp.close()

    def fileno(self) -> int:
        self._incr_stats(FILENO_COUNT_KEY)
        return INVALID_FD

    def flush(self) -> None:
        self._incr_stats(FLUSH_COUNT_KEY)
        self._fp.flush()

    def write(self, buffer: bytes) -> int:
        start = time.perf_counter()
        written = self._fp.write(buffer)
        self._incr_stats(WRITE_SEC_KEY, time.perf_counter() - start)
        self._incr_stats(WRITE_COUNT_KEY)
        self._incr_stats(WRITE_BYTES_KEY, written)
        return written
