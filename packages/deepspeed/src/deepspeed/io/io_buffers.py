"""The pinned staging buffer of ``FastFileWriter``: one slot (each drain waits for its write) or two (one slot
fills while the other drains).

Ownership: a slot belongs to the writer while it fills; from ``drain`` until the next ``wait_drained`` it belongs
to the aio handle, which reads it asynchronously, and nothing may write it. ``fill`` only ever writes the slot
not in flight; before a slot is filled again, its previous drain has been waited for.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ds_ops.aio.async_io import deepspeed_memcpy


class PinnedIOBuffer:
    """``slots`` equal parts of ``pinned`` (a 1-D uint8 CPU tensor), drained to ``fd`` through ``handle``."""

    def __init__(self, pinned: torch.Tensor, handle: Any, slots: int) -> None:
        size = pinned.numel() // slots
        self._slots = [pinned.narrow(0, i * size, size) for i in range(slots)]
        self._handle = handle
        self._fill = 0  # the slot being filled
        self._offset = 0  # bytes in it
        self._in_flight = False  # a drain not waited for yet (the other slot, or this one when single)

    @property
    def filled(self) -> int:
        return self._offset

    def fill(self, src: torch.Tensor, start: int) -> int:
        """Copy bytes of ``src`` from ``start`` into the current slot; returns how many fit."""
        slot = self._slots[self._fill]
        count = min(src.numel() - start, slot.numel() - self._offset)
        deepspeed_memcpy(slot.narrow(0, self._offset, count), src.narrow(0, start, count))
        self._offset += count
        return count

    def is_full(self) -> bool:
        return self._offset == self._slots[self._fill].numel()

    def drain(self, fd: int, file_offset: int) -> int:
        """Start writing the filled bytes of the current slot at ``file_offset``; returns their count. With two
        slots the write runs on while the other slot fills; with one it is waited for here."""
        count = self._offset
        if count == 0:
            return 0
        self.wait_drained()  # the slot about to be handed out must not still be in flight
        self._handle.async_pwrite(self._slots[self._fill].narrow(0, 0, count), fd, file_offset)
        self._in_flight = True
        if len(self._slots) == 1:
            self.wait_drained()
        self._fill = (self._fill + 1) % len(self._slots)
        self._offset = 0
        return count

    def wait_drained(self) -> None:
        if self._in_flight:
            self._in_flight = False
            self._handle.wait()  # raises the write's error, if any


def check_pinned_tensor(pinned: object, alignment: int, slots: int) -> torch.Tensor:
    """``pinned`` if it can be the staging buffer, else a ValueError saying what is needed."""
    if not isinstance(pinned, torch.Tensor):
        raise TypeError(f"FastFileWriter: pinned_tensor must be a torch.Tensor, got {type(pinned).__name__}")
    if pinned.device.type != "cpu" or pinned.dtype != torch.uint8 or pinned.dim() != 1 or not pinned.is_contiguous():
        raise ValueError(f"FastFileWriter: pinned_tensor must be a contiguous 1-D uint8 CPU tensor, got {pinned.dtype} "
                         f"of shape {tuple(pinned.shape)} on {pinned.device}")
    unit = alignment * slots
    if pinned.numel() == 0 or pinned.numel() % unit:
        raise ValueError(f"FastFileWriter: pinned_tensor holds {pinned.numel()} bytes; it must be a positive multiple "
                         f"of {unit} (the handle's alignment {alignment} x {slots} buffer slot(s))")
    return pinned


def open_for_writing(path: str) -> int:
    """A fresh descriptor on ``path``, truncated: the checkpoint replaces whatever was there (a longer old file
    must not leave its tail after the new bytes)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
