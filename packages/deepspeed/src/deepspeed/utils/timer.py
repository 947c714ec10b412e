"""``deepspeed.utils.timer``: DeepSpeed's named wall-clock timers and samples/s meter (Megatron's API).

``SynchronizedWallClockTimer`` keeps named timers (``timers("fwd").start()`` / ``.stop()`` / ``.elapsed()``, in
ms). On a synchronized device (CPU) a timer reads the host clock; on an accelerator it records a pair of device
events, so it measures the queued kernels without blocking the host until the time is read. ``NoopTimer`` has
the same surface and does nothing. ``ThroughputTimer`` reports samples/s over the optimizer steps after
``start_step`` warm-up steps. The engine's own phase timers (``runtime.engine._timers``) are a smaller, internal API.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from deepspeed.accelerator import get_accelerator
from deepspeed.utils.logging import logger

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"
TIME_EPSILON = 1e-6
_GB = 1024**3


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


def _print_on(message: str, ranks: Iterable[int]) -> None:
    """Print on the listed ranks (``-1`` in ``ranks``: every rank; before init: this process)."""
    rank, ranks = _rank(), set(ranks)
    if rank == -1 or -1 in ranks or rank in ranks:
        print(f"[Rank {rank}] {message}", flush=True)


class CudaEventTimer:
    """One measured interval between two recorded device events."""

    def __init__(self, start_event: Any, end_event: Any) -> None:
        self.start_event = start_event
        self.end_event = end_event

    def get_elapsed_msec(self) -> float:
        get_accelerator().current_stream().wait_event(self.end_event)
        self.end_event.synchronize()
        return self.start_event.elapsed_time(self.end_event)


class SynchronizedWallClockTimer:
    """Group of named timers (borrowed from Megatron); ``timers(name)`` creates one on first use."""

    class Timer:
        """One named timer accumulating intervals until ``reset``; times in ms."""

        def __init__(self, name: str) -> None:
            self.name_ = name
            self.started_ = False
            self.event_timers: list[Any] = []
            self.use_host_timer = get_accelerator().use_host_timers()
            self.start_event: Any = None
            self.elapsed_records: list[float] | None = None
            self.start_time = 0.0
            self.end_time = 0.0

        def start(self) -> None:
            if self.started_:
                raise RuntimeError(f"{self.name_} timer has already been started")
            if self.use_host_timer:
                self.start_time = time.time()
            else:
                self.start_event = get_accelerator().Event(enable_timing=True)
                self.start_event.record()
            self.started_ = True

        def stop(self, reset: bool = False, record: bool = False) -> None:
            """End the running interval (``reset``/``record`` are accepted for DeepSpeed's callers)."""
            if not self.started_:
                raise RuntimeError(f"{self.name_} timer is not started")
            if self.use_host_timer:
                self.end_time = time.time()
                self.event_timers.append(self.end_time - self.start_time)
            else:
                end_event = get_accelerator().Event(enable_timing=True)
                end_event.record()
                self.event_timers.append(CudaEventTimer(self.start_event, end_event))
                self.start_event = None
            self.started_ = False

        def _get_elapsed_msec(self) -> float:
            if self.use_host_timer:
                self.elapsed_records = [et * 1000.0 for et in self.event_timers]
            else:
                self.elapsed_records = [et.get_elapsed_msec() for et in self.event_timers]
            return sum(self.elapsed_records)

        def reset(self) -> None:
            self.started_ = False
            self.start_event = None
            self.elapsed_records = None
            self.event_timers.clear()

        def elapsed(self, reset: bool = True) -> float:
            """Total ms of the recorded intervals (a running interval is closed and restarted)."""
            started = self.started_
            if started:
                self.stop()
            elapsed = self._get_elapsed_msec()
            if reset:
                self.reset()
            if started:
                self.start()
            return elapsed

        def mean(self) -> float:
            """Mean interval in ms, the shortest and longest 10% left out."""
            self.elapsed(reset=False)
            return trim_mean(self.elapsed_records or [], 0.1)

    def __init__(self) -> None:
        self.timers: dict[str, SynchronizedWallClockTimer.Timer] = {}

    def get_timers(self) -> dict[str, Timer]:
        return self.timers

    def __call__(self, name: str) -> Timer:
        if name not in self.timers:
            self.timers[name] = self.Timer(name)
        return self.timers[name]

    @staticmethod
    def memory_usage() -> str:
        acc = get_accelerator()
        return (f" | mem_allocated: {acc.memory_allocated() / _GB:.4f} GB"
                f" | max_mem_allocated: {acc.max_memory_allocated() / _GB:.4f} GB"
                f" | cache_allocated: {acc.memory_cached() / _GB:.4f} GB"
                f" | max_cache_allocated: {acc.max_memory_cached() / _GB:.4f} GB")

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: Sequence[int] | None = None) -> None:
        """Print ``time (ms) | name: ms | ...`` for the named timers on ``ranks`` (default rank 0);
        ``memory_breakdown`` is accepted and, as in DeepSpeed 0.19, adds nothing."""
        if not normalizer > 0.0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        line = "time (ms)"
        for name in names:
            if name in self.timers:
                line += f" | {name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
        _print_on(line, ranks or [0])

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """``{name: mean * 1000 / normalizer}`` for the named timers (DeepSpeed's scaling of the ms mean)."""
        if not normalizer > 0.0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        return {name: self.timers[name].mean() * 1000.0 / normalizer for name in names if name in self.timers}


class NoopTimer:
    """``SynchronizedWallClockTimer``'s surface, measuring nothing (timing off)."""

    class Timer:
        def start(self) -> None: ...

        def reset(self) -> None: ...

        def stop(self, **kwargs: Any) -> None: ...

        def elapsed(self, **kwargs: Any) -> float:
            return 0

        def mean(self) -> float:
            return 0

    def __init__(self) -> None:
        self.timer = self.Timer()

    def __call__(self, name: str) -> Timer:
        return self.timer

    def get_timers(self) -> dict[str, Any]:
        return {}

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks: Sequence[int] | None = None) -> None: ...

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> None: ...


def _option(config: Any, name: str) -> bool:
    """``config.<name>`` (an object, e.g. DeepSpeed's ``timers.throughput`` section, or a dict); None: True."""
    if config is None:
        return True
    return bool(config.get(name, True) if isinstance(config, dict) else getattr(config, name))


class ThroughputTimer:
    """Samples/s of training: ``start()``/``stop(global_step=...)`` around each micro step; the first
    ``start_step`` optimizer steps are warm-up and not timed. ``config`` has ``enabled`` and ``synchronized``
    (synchronise the device around each measurement)."""

    def __init__(self, config: Any, batch_size: int | None, start_step: int = 2, steps_per_output: int | None = None,
                 monitor_memory: bool = False, logging_fn: Callable[[str], Any] | None = None) -> None:
        self.config = config
        self.enabled = _option(config, "enabled")
        self.synchronized = _option(config, "synchronized")
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        if steps_per_output is not None and steps_per_output <= 0:
            raise ValueError(f"steps_per_output must be a positive integer or None, got {steps_per_output}")
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn or logger.info
        self.initialized = False
        if monitor_memory:
            import psutil  # noqa: F401 - DeepSpeed requires psutil for monitor_memory

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def _init_timer(self) -> None:
        self.initialized = True

    def start(self) -> None:
        if not self.enabled:
            return
        self._init_timer()
        self.started = True
        if self.global_step_count >= self.start_step:
            if self.synchronized:
                get_accelerator().synchronize()
            self.start_time = time.time()

    def _is_report_boundary(self) -> bool:
        return self.steps_per_output is not None and self.global_step_count % self.steps_per_output == 0

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            if self.synchronized:
                get_accelerator().synchronize()
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                if report_speed and self._is_report_boundary():
                    self._report()
                self.step_elapsed_time = 0

    def _report(self) -> None:
        acc = get_accelerator()
        where = f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/global_step={self.global_step_count}"
        self.logging(f"{where}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                     f"CurrSamplesPerSec={self.batch_size / (self.step_elapsed_time + TIME_EPSILON)}, "
                     f"MemAllocated={round(acc.memory_allocated() / _GB, 2)}GB, "
                     f"MaxMemAllocated={round(acc.max_memory_allocated() / _GB, 2)}GB")
        if self.monitor_memory:
            import psutil

            self.logging(f"{where}, vm %: {psutil.virtual_memory().percent}, swap %: {psutil.swap_memory().percent}")

    def avg_samples_per_sec(self) -> float:
        """Samples/s averaged over the timed steps (``-inf`` before any)."""
        timed_steps = self.global_step_count - self.start_step
        if self.global_step_count > 0 and timed_steps > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed_steps)
        return float("-inf")


def trim_mean(data: list[float], trim_percent: float) -> float:
    """Mean of ``data`` without its lowest and highest ``trim_percent`` fraction; 0 if empty (``data`` is not
    reordered: callers pass parallel lists)."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent must be in [0, 1], got {trim_percent}")
    n = len(data)
    if n == 0:
        return 0
    k = int(round(n * trim_percent))
    kept = sorted(data)[k:n - k]
    return sum(kept) / len(kept) if kept else float("nan")
