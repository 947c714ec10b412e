"""Helpers the multi-rank benchmarks share: starting ranks, the machine line, paired ratios."""

from __future__ import annotations

import platform
import socket
import statistics
from collections.abc import Callable
from typing import Any

# torch.distributed.nn.functional binds ``group.WORLD`` as a default argument when it is first imported, and
# torch imports it lazily (the first torch.optim optimizer imports torch._dynamo, which imports it). Imported
# after init_process_group, those defaults keep the default group alive past destroy_process_group: its gloo
# threads then outlive the interpreter, and one that drops the last reference to a Python-owned tensor
# during interpreter exit aborts the rank ("terminate called without an active exception"). Importing it
# here binds None instead: spawned ranks import the benchmark's main module, hence this one, before the
# rank function runs, so before any process group exists.
import torch.distributed.nn  # noqa: F401
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(rank_main: Callable[..., None], args: Any, world_size: int) -> Any:
    """Run ``rank_main(rank, args, port, queue)`` on ``world_size`` fresh processes; returns what rank 0 puts
    on the queue."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(rank_main, args=(args, free_port(), queue), nprocs=world_size, join=True,
                       start_method="spawn")
    return queue.get()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def paired(num: list[float], den: list[float]) -> float:
    """Median over repetitions of num/den (each repetition's runs are adjacent in time, so drifting load
    cancels)."""
    return statistics.median(n / d for n, d in zip(num, den, strict=True))
