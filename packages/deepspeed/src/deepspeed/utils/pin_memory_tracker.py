"""``deepspeed.utils.pin_memory_tracker``: a process-wide count of the host memory pinned through the accelerator.

Pinned (page-locked) memory cannot be swapped and counts against the memlock limit (``ulimit -l``); a host that
runs out of RAM during offload usually ran out here, far from the allocation that tipped it. The accelerator's
``pin_memory`` reports every pinned copy to :func:`track_pinned_memory`; the running total is logged at DEBUG per
call and at INFO each time it crosses 32 GB, 64 GB, 128 GB, ... (a handful of lines even for terabytes), and
:func:`pinned_memory_summary` logs it on request (ZeRO offload setup calls it).
"""

from __future__ import annotations

from deepspeed.utils.logging import logger

_GB = 1 << 30
_FIRST_CHECKPOINT = 32 * _GB

__all__ = ["pinned_memory_summary", "track_pinned_memory"]


def _fmt_bytes(num_bytes: int) -> str:
    """``512 B``, ``2.0 KB``, ``1.00 MB``, ``3.000 GB``: more digits for larger units, where they matter."""
    for unit, digits, scale in (("GB", 3, _GB), ("MB", 2, 1 << 20), ("KB", 1, 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.{digits}f} {unit}"
    return f"{num_bytes} B"


class _PinnedMemoryTracker:
    """The running total (``_bytes`` over ``_calls`` pinned copies) and the next total to log at INFO."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._bytes = 0
        self._calls = 0
        self._next_checkpoint = _FIRST_CHECKPOINT

    def track(self, num_bytes: int) -> None:
        self._bytes += int(num_bytes)
        self._calls += 1
        logger.debug(f"pin_memory: +{_fmt_bytes(num_bytes)} (call #{self._calls}, running total: "
                     f"{_fmt_bytes(self._bytes)})")
        if self._bytes < self._next_checkpoint:
            return
        crossed = self._next_checkpoint
        while self._next_checkpoint <= self._bytes:  # one allocation may cross several thresholds: one line
            crossed = self._next_checkpoint
            self._next_checkpoint *= 2
        logger.info(f"[pinned-memory checkpoint] crossed {_fmt_bytes(crossed)}: {_fmt_bytes(self._bytes)} pinned "
                    f"across {self._calls} allocations")

    def log_summary(self, tag: str = "") -> None:
        label = f"[pinned-memory {tag}]" if tag else "[pinned-memory]"
        logger.info(f"{label} {_fmt_bytes(self._bytes)} pinned across {self._calls} allocations")


_tracker = _PinnedMemoryTracker()


def track_pinned_memory(num_bytes: int) -> None:
    """Add ``num_bytes`` (a pinned copy's ``nbytes``) to the process's total."""
    _tracker.track(num_bytes)


def pinned_memory_summary(tag: str = "") -> None:
    """Log the total pinned so far (INFO), labelled with ``tag``."""
    _tracker.log_summary(tag)
