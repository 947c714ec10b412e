"""``MockFileWriter``: counts what would be written without writing it (the file is created, empty), to measure
serialization alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepspeed.io.base_file_writer import BaseFileWriter
from deepspeed.io.constants import (
    CLOSE_COUNT_KEY,
    FILENO_COUNT_KEY,
    FLUSH_COUNT_KEY,
    INVALID_FD,
    SAVE_STORAGE_BYTES_KEY,
    SAVE_STORAGE_KEY,
    STORAGE_OBJ_SIZE,
    WRITE_BYTES_KEY,
    WRITE_COUNT_KEY,
)
from deepspeed.io.utils import obj_serialization_details


class MockFileWriter(BaseFileWriter):
    def __init__(self, file_path: str) -> None:
        super().__init__(file_path)
        self._fp = open(self._file_path, "wb")  # noqa: SIM115 - held until close(), as a file object is
        self._stats[SAVE_STORAGE_KEY] = 0
        self._stats[SAVE_STORAGE_BYTES_KEY] = 0

    def close(self) -> None:
        self._incr_stats(CLOSE_COUNT_KEY)
        self._fp.close()

    def fileno(self) -> int:
        self._incr_stats(FILENO_COUNT_KEY)
        return INVALID_FD

    def flush(self) -> None:
        self._incr_stats(FLUSH_COUNT_KEY)

    def write(self, buffer: bytes) -> int:
        return self._count(len(buffer))

    def save_torch_storage_object_list(self, storage_obj_list: Sequence[Any], save_size: bool) -> int:
        total = 0
        for storage_obj in storage_obj_list:
            details = obj_serialization_details()(storage_obj)
            self._incr_stats(SAVE_STORAGE_KEY)
            self._incr_stats(SAVE_STORAGE_BYTES_KEY, details.nbytes)
            total += (self._count(STORAGE_OBJ_SIZE) if save_size else 0) + self._count(details.nbytes)
        return total

    def _count(self, num_bytes: int) -> int:
        self._incr_stats(WRITE_COUNT_KEY)
        self._incr_stats(WRITE_BYTES_KEY, num_bytes)
        return num_bytes
