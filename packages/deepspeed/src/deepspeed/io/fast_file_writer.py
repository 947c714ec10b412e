"""``FastFileWriter``: ``torch.save`` straight to NVMe through DeepNVMe (an ``aio_handle``) and a pinned buffer.

``torch.save(obj, f=FastFileWriter(path, FastFileWriterConfig(handle, pinned)))`` hands the writer the serialized
bytes; they are gathered into ``pinned`` (page-locked, a multiple of ``handle.get_alignment()`` bytes; with
``double_buffer`` split in two so one half fills while the other is written) and each full half goes to the file
with ``async_pwrite`` on the writer's descriptor, O_DIRECT where aligned. ``close()`` writes the rest (the
unaligned tail through the page cache), fsyncs and closes the descriptor: the file is complete and durable
when ``close`` returns, and no descriptor outlives it. See ``deepspeed.io.io_buffers`` for who owns which half
when.

With ``num_parallel_writers > 1``, ``save_torch_storage_object_list`` writes only this ``writer_rank``'s
contiguous share of the storages' byte stream (the shares of all ranks, in rank order, make the whole stream).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed.io.base_file_writer import BaseFileWriter
from deepspeed.io.constants import (
    AIO_FILL_BUFFER_COUNT_KEY,
    AIO_FILL_BUFFER_SEC_KEY,
    AIO_FILL_BUFFER_SPEED_KEY,
    AIO_SPEED_KEY,
    AIO_WRITE_BYTES_KEY,
    AIO_WRITE_SEC_KEY,
    CLOSE_COUNT_KEY,
    FILENO_COUNT_KEY,
    FLUSH_COUNT_KEY,
    INVALID_FD,
    SAVE_STORAGE_BYTES_KEY,
    SAVE_STORAGE_KEY,
    SLOW_WRITE_BYTES_KEY,
    SLOW_WRITE_SEC_KEY,
    WRITE_BYTES_KEY,
    WRITE_COUNT_KEY,
    WRITE_SEC_KEY,
)
from deepspeed.io.io_buffers import PinnedIOBuffer, check_pinned_tensor, open_for_writing
from deepspeed.io.utils import bytes_to_tensor, partition_bytes, storage_byte_tensors

FASTIO_STAT_KEYS = [AIO_WRITE_SEC_KEY, AIO_WRITE_BYTES_KEY, AIO_SPEED_KEY, SLOW_WRITE_BYTES_KEY, SLOW_WRITE_SEC_KEY,
                    AIO_FILL_BUFFER_COUNT_KEY, AIO_FILL_BUFFER_SEC_KEY, AIO_FILL_BUFFER_SPEED_KEY, SAVE_STORAGE_KEY,
                    SAVE_STORAGE_BYTES_KEY]


@dataclass
class FastFileWriterConfig:
    """``dnvme_handle``: an ``aio_handle``; ``pinned_tensor``: the staging buffer (1-D uint8, page-locked, a
    multiple of the handle's alignment, twice that with ``double_buffer``); ``num_parallel_writers`` /
    ``writer_rank``: this writer's share of ``save_torch_storage_object_list``; ``global_rank``: for logs."""

    dnvme_handle: Any
    pinned_tensor: torch.Tensor
    double_buffer: bool = True
    num_parallel_writers: int = 1
    writer_rank: int = 0
    global_rank: int = 0


def _check_config(config: object) -> FastFileWriterConfig:
    if not isinstance(config, FastFileWriterConfig):
        raise TypeError(f"FastFileWriter: config must be a FastFileWriterConfig, got {type(config).__name__}")
    handle = config.dnvme_handle
    missing = [m for m in ("async_pwrite", "wait", "get_alignment") if not callable(getattr(handle, m, None))]
    if missing:
        raise TypeError(f"FastFileWriter: dnvme_handle must be an aio handle; {type(handle).__name__} lacks {missing}")
    n, rank = config.num_parallel_writers, config.writer_rank
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"FastFileWriter: num_parallel_writers must be a positive int, got {n!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
        raise ValueError(f"FastFileWriter: writer_rank must be an int in [0, {n}), got {rank!r}")
    return config


class FastFileWriter(BaseFileWriter):
    def __init__(self, file_path: str, config: FastFileWriterConfig | None = None, *, aio_handle: Any = None,
                 pinned_tensor: torch.Tensor | None = None) -> None:
        super().__init__(file_path)
        if config is None:  # older DeepSpeed's keywords (its NVMe benchmark still passes them)
            config = FastFileWriterConfig(dnvme_handle=aio_handle, pinned_tensor=pinned_tensor)
        self._config = _check_config(config)
        self._handle = config.dnvme_handle
        slots = 2 if config.double_buffer else 1
        pinned = check_pinned_tensor(config.pinned_tensor, self._handle.get_alignment(), slots)
        self._io_buffer = PinnedIOBuffer(pinned, self._handle, slots)
        self._fd = open_for_writing(self._file_path)
        self._file_offset = 0
        for key in FASTIO_STAT_KEYS:
            self._stats[key] = 0

    # -- the file-object interface torch.save uses ----------------------------------------------------------
    def write(self, buffer: bytes | bytearray | memoryview) -> int:
        self._check_open("write")
        data = bytes_to_tensor(buffer)
        return self._write_tensor(data)

    def flush(self) -> None:
        """Counted only: bytes reach the file as the buffer fills and at ``close()``."""
        self._incr_stats(FLUSH_COUNT_KEY)

    def fileno(self) -> int:
        self._incr_stats(FILENO_COUNT_KEY)
        return INVALID_FD  # torch must write through write(), into the pinned buffer

    def close(self) -> None:
        """Write what is buffered, wait for every write, fsync and close the descriptor (once; later calls
        only count)."""
        self._incr_stats(CLOSE_COUNT_KEY)
        if self._fd == INVALID_FD:
            return
        fd, self._fd = self._fd, INVALID_FD
        try:
            start = time.perf_counter()
            self._drain(fd)
            self._io_buffer.wait_drained()
            self._incr_stats(AIO_WRITE_SEC_KEY, time.perf_counter() - start)
            os.fsync(fd)
        finally:
            os.close(fd)

    def __enter__(self) -> FastFileWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_fd", INVALID_FD) != INVALID_FD:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to report to
                pass

    # -- DeepSpeed's storage-list entry point --------------------------------------------------------------
    def save_torch_storage_object_list(self, storage_obj_list: Sequence[Any], save_size: bool) -> int:
        """Write ``(untyped storage, dtype)`` pairs (each preceded by its int64 element count when ``save_size``);
        with several parallel writers only this rank's share. Returns the bytes this writer wrote."""
        self._check_open("save_torch_storage_object_list")
        pieces = storage_byte_tensors(storage_obj_list, save_size)
        if self._config.num_parallel_writers > 1:
            pieces = partition_bytes(pieces, self._config.num_parallel_writers, self._config.writer_rank)
        written = sum(self._write_tensor(piece) for piece in pieces)
        self._incr_stats(SAVE_STORAGE_KEY, len(storage_obj_list))
        self._incr_stats(SAVE_STORAGE_BYTES_KEY, written)
        return written

    # -- internals ------------------------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._fd == INVALID_FD:
            raise ValueError(f"FastFileWriter.{what}: {self._file_path!r} is closed")

    def _write_tensor(self, data: torch.Tensor) -> int:
        start, done = time.perf_counter(), 0
        while done < data.numel():
            fill_start = time.perf_counter()
            done += self._io_buffer.fill(data, done)
            self._incr_stats(AIO_FILL_BUFFER_SEC_KEY, time.perf_counter() - fill_start)
            self._incr_stats(AIO_FILL_BUFFER_COUNT_KEY)
            if self._io_buffer.is_full():
                self._drain(self._fd)
        self._incr_stats(WRITE_COUNT_KEY)
        self._incr_stats(WRITE_BYTES_KEY, done)
        self._incr_stats(WRITE_SEC_KEY, time.perf_counter() - start)
        return done

    def _drain(self, fd: int) -> None:
        start = time.perf_counter()
        count = self._io_buffer.drain(fd, self._file_offset)
        self._file_offset += count
        self._incr_stats(AIO_WRITE_SEC_KEY, time.perf_counter() - start)
        self._incr_stats(AIO_WRITE_BYTES_KEY, count)

    def _dump_state(self) -> dict[str, float | str]:
        if self._stats[AIO_WRITE_SEC_KEY] > 0:
            self._stats[AIO_SPEED_KEY] = self._stats[AIO_WRITE_BYTES_KEY] / self._stats[AIO_WRITE_SEC_KEY] / (1 << 30)
        if self._stats[AIO_FILL_BUFFER_SEC_KEY] > 0:
            self._stats[AIO_FILL_BUFFER_SPEED_KEY] = (self._stats[AIO_WRITE_BYTES_KEY]
                                                      / self._stats[AIO_FILL_BUFFER_SEC_KEY] / (1 << 30))
        return super()._dump_state()
