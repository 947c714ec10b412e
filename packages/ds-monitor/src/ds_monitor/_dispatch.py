"""A single background thread that runs the monitors' writes, so the training step never waits on a backend."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

__all__ = ["BackgroundWriter"]

logger = logging.getLogger("ds_monitor")

_STOP = object()


class BackgroundWriter:
    """Runs submitted calls one after another, in submission order, on a daemon thread.

    ``submit`` never blocks: when ``max_pending`` calls are already waiting (a backend stalled on a dead network
    or a full disk) the new call is dropped, counted in ``dropped``, and the first drop logs one warning.
    """

    def __init__(self, max_pending: int = 1024, name: str = "ds-monitor-writer") -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], None]) -> bool:
        """Queue ``call``; False when it was dropped because the queue is full."""
        try:
            self._queue.put_nowait(call)
            return True
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("monitor backends are %d event batches behind; dropping new events until they catch "
                               "up (the training step is not slowed down)", self._queue.maxsize)
            return False

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every queued call ran; True when it did."""
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._queue.all_tasks_done.wait(remaining)
        return True

    def stop(self, timeout: float) -> bool:
        """Run what is queued (up to ``timeout`` seconds), then end the thread; True when it ended."""
        if not self._thread.is_alive():
            return True
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            call = self._queue.get()
            try:
                if call is _STOP:
                    return
                call()
            except Exception as exc:  # the monitors guard their own backends; this keeps the thread alive
                logger.warning("monitor writer thread: unexpected %s", type(exc).__name__)
            finally:
                self._queue.task_done()
