"""Checksums of what the swappers wrote, checked on every read back: a swap file that was modified behind the
swapper's back, or a disk that returns other bytes than it was given, raises instead of being trained on.

The swap files are private to the running process (its own ``pid<P>-<N>`` folder, deleted at exit), so the
checksums live in memory only: one CRC32 (``zlib.crc32``, which releases the GIL and runs at about 2 GB/s
on one core) per written byte range, recorded from the write's source when the write is submitted (the source
may not change until the write is waited for, by the swappers' ownership rule) and compared with the buffer
after the read of that exact range was waited for. A read of a range that was not written as one piece (the
whole gradient file after piecewise writes during backward) is not checked.

``DS_SWAP_VERIFY=0`` turns the checks off (the benchmark's baseline; a disk known good and a step that cannot
spare the ~0.5 ms per MB); the default is on.
"""

from __future__ import annotations

import ctypes
import os
import time
import zlib

import torch

from ds_ops.aio import AioError

VERIFY_ENV = "DS_SWAP_VERIFY"


def enabled() -> bool:
    """Whether swap reads are verified (``DS_SWAP_VERIFY`` unset or not ``0``/``false``/``off``)."""
    return os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def crc32(t: torch.Tensor) -> int:
    """CRC32 of a contiguous CPU tensor's bytes (read in place through ctypes: ds-zero does not depend on numpy)."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    if flat.numel() == 0:
        return zlib.crc32(b"")
    return zlib.crc32((ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr()))


class SwapCorruptionError(AioError):
    """A swap file read back other bytes than were written to it."""


class SwapChecksums:
    """CRC32 per written ``(path, byte offset, byte length)``; ``rank`` names the owner in errors."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.on = enabled()
        self._sums: dict[str, dict[tuple[int, int], int]] = {}
        self.checked_bytes = 0
        self.seconds = 0.0  # spent computing checksums (the price of the checks, for benchmarks)

    def record(self, path: str, tensor: torch.Tensor, offset: int = 0, whole_file: bool = True) -> None:
        """``tensor`` is being written at byte ``offset`` of ``path`` (``whole_file``: it becomes the file)."""
        if not self.on:
            return
        nbytes = tensor.numel() * tensor.element_size()
        sums = {} if whole_file else self._sums.get(path, {})
        for start, length in list(sums):  # an overlapped range no longer holds what its checksum says
            if start < offset + nbytes and offset < start + length:
                del sums[(start, length)]
        start = time.perf_counter()
        sums[(offset, nbytes)] = crc32(tensor)
        self.seconds += time.perf_counter() - start
        self._sums[path] = sums

    def forget(self, path: str) -> None:
        self._sums.pop(path, None)

    def verify(self, path: str, tensor: torch.Tensor, offset: int = 0, what: str = "") -> None:
        """Raise :class:`SwapCorruptionError` if ``tensor`` (just read from byte ``offset`` of ``path``) differs
        from what was written there."""
        if not self.on:
            return
        nbytes = tensor.numel() * tensor.element_size()
        expected = self._sums.get(path, {}).get((offset, nbytes))
        if expected is None:
            return
        start = time.perf_counter()
        actual = crc32(tensor)
        self.seconds += time.perf_counter() - start
        self.checked_bytes += nbytes
        if actual != expected:
            raise SwapCorruptionError(
                f"{what}: verify read" if what else "verify swap read", path, None,
                f"rank {self.rank}: the {nbytes} bytes read at offset {offset} have CRC32 {actual:#010x}, but "
                f"{expected:#010x} was written: the swap file was modified by something else than this process, "
                f"or the disk returned bad data (set {VERIFY_ENV}=0 to skip this check)")
