"""Test-only I/O jitter: every asynchronous swap transfer lands after a random delay, so that the order in
which reads and writes complete, relative to the step and to each other, changes from run to run.

``DS_SWAP_IO_JITTER_MS=<max>`` (milliseconds, > 0) makes the swappers' aio handles :class:`JitterHandle` s;
``DS_SWAP_IO_JITTER_SEED`` seeds the delays (default: a different seed per handle and process). Unset (the
default), the swappers use the plain handle: nothing of this module is on the I/O path.

An ``async_pread``/``async_pwrite`` reaches the real handle only after its delay, on a timer thread, so the
transfer itself (not merely the notice of its end) happens late and possibly after requests started later:
a buffer read before its read was waited for holds stale bytes, a buffer reused before its write was waited
for sends the new bytes, a file read before its write was waited for gives the old contents. ``wait()`` waits
for every delayed request to be submitted, then for the real handle; an error met when submitting late is
raised there. Synchronous calls are delayed as well, then run.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

JITTER_ENV = "DS_SWAP_IO_JITTER_MS"
SEED_ENV = "DS_SWAP_IO_JITTER_SEED"


def jitter_ms() -> float:
    """The maximum delay asked for by ``DS_SWAP_IO_JITTER_MS`` (0: off)."""
    raw = os.environ.get(JITTER_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0.0:  # also refuses nan
        raise ValueError(f"{JITTER_ENV}={raw!r}: accepted is a number of milliseconds >= 0 (the largest delay "
                         "injected before each swap transfer; unset or 0 turns it off)")
    return value


def maybe_jitter(handle: Any) -> Any:
    """``handle`` itself, or wrapped in a :class:`JitterHandle` when ``DS_SWAP_IO_JITTER_MS`` asks for it."""
    most = jitter_ms()
    if most == 0.0:
        return handle
    seed = os.environ.get(SEED_ENV)
    return JitterHandle(handle, most / 1000.0, None if seed is None else int(seed))


class JitterHandle:
    """An ``AsyncIOHandle`` whose requests start after a random delay in ``[0, max_delay_s]``."""

    def __init__(self, inner: Any, max_delay_s: float, seed: int | None = None) -> None:
        self.inner, self.max_delay_s = inner, max_delay_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._timers: list[threading.Timer] = []
        self._late_error: BaseException | None = None

    def __getattr__(self, name: str) -> Any:  # settings, counters: the real handle's
        return getattr(self.inner, name)

    def _delay(self) -> float:
        with self._lock:
            return self._rng.uniform(0.0, self.max_delay_s)

    def _later(self, call: Any, *args: Any, **kwargs: Any) -> int:
        def submit() -> None:
            try:
                call(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 (raised again by wait(), as the real handle's would be)
                with self._lock:
                    self._late_error = self._late_error or exc

        timer = threading.Timer(self._delay(), submit)
        timer.daemon = True
        with self._lock:
            self._timers.append(timer)
        timer.start()
        return 0

    def async_pread(self, tensor: Any, path: Any, offset: int = 0) -> int:
        return self._later(self.inner.async_pread, tensor, path, offset)

    def async_pwrite(self, tensor: Any, path: Any, offset: int = 0, **kwargs: Any) -> int:
        return self._later(self.inner.async_pwrite, tensor, path, offset, **kwargs)

    def sync_pread(self, *args: Any, **kwargs: Any) -> int:
        time.sleep(self._delay())
        return self.inner.sync_pread(*args, **kwargs)

    def sync_pwrite(self, *args: Any, **kwargs: Any) -> int:
        time.sleep(self._delay())
        return self.inner.sync_pwrite(*args, **kwargs)

    def _submitted(self) -> BaseException | None:
        with self._lock:
            timers, self._timers = self._timers, []
        for t in timers:
            t.join()
        with self._lock:
            error, self._late_error = self._late_error, None
        return error

    def wait(self) -> int:
        late = self._submitted()
        try:
            done = self.inner.wait()
        except BaseException:
            if late is not None:
                raise late from None
            raise
        if late is not None:
            raise late
        return done

    def pending(self) -> int:
        with self._lock:
            late = sum(not t.finished.is_set() for t in self._timers)  # not yet handed to the real handle
        return late + self.inner.pending()

    def close(self) -> None:
        self._submitted()
        self.inner.close()
