"""Wall-clock timers of the training phases (``wall_clock_breakdown``) and the samples/s throughput meter.

Times are in milliseconds. On an accelerator the device is synchronised around each measurement so the
time covers the queued kernels, which is why timing is off unless ``wall_clock_breakdown`` (or the flops
profiler) asks for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

FORWARD = "forward"
BACKWARD = "backward"
BACKWARD_INNER = "backward_inner"
BACKWARD_REDUCE = "backward_allreduce"
STEP = "step"
PHASES = (FORWARD, BACKWARD, BACKWARD_INNER, BACKWARD_REDUCE, STEP)


class PhaseTimers:
    """Accumulated milliseconds per phase since the last ``reset``; ``enabled=False`` makes every call free."""

    def __init__(self, enabled: bool, synchronize: Callable[[], None] | None = None) -> None:
        self.enabled = enabled
        self.synchronize = synchronize or (lambda: None)
        self.elapsed_ms = dict.fromkeys(PHASES, 0.0)
        self._started: dict[str, float] = {}

    def start(self, name: str) -> None:
        if self.enabled:
            self.synchronize()
            self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.enabled and name in self._started:
            self.synchronize()
            self.add(name, (time.perf_counter() - self._started.pop(name)) * 1e3)

    def add(self, name: str, ms: float) -> None:
        if self.enabled:
            self.elapsed_ms[name] = self.elapsed_ms.get(name, 0.0) + ms

    def reset(self) -> None:
        self.elapsed_ms = dict.fromkeys(PHASES, 0.0)

    def line(self) -> str:
        """``forward: 1.23 | backward: ...`` in ms."""
        return " | ".join(f"{name}: {ms:.2f}" for name, ms in self.elapsed_ms.items())


class Throughput:
    """Samples per second over the optimizer steps since the last ``report`` (wall clock)."""

    def __init__(self) -> None:
        self._since = time.perf_counter()
        self._samples = 0

    def add(self, samples: int) -> None:
        self._samples += samples

    def report(self) -> float:
        """Samples/s since the previous report; resets the window."""
        now = time.perf_counter()
        rate = self._samples / max(now - self._since, 1e-9)
        self._since, self._samples = now, 0
        return rate
