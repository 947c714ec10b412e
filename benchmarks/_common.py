"""Helpers the benchmarks share: starting ranks, the machine line, paired ratios, integer options, a small MLP
and per-step timing across ranks."""

from __future__ import annotations

import argparse
import functools
import platform
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

# torch.distributed.nn.functional binds ``group.WORLD`` as a default argument when it is first imported, and
# torch imports it lazily (the first torch.optim optimizer imports torch._dynamo, which imports it). Imported
# after init_process_group, those defaults keep the default group alive past destroy_process_group: its gloo
# threads then outlive the interpreter, and one that drops the last reference to a Python-owned tensor
# during interpreter exit aborts the rank ("terminate called without an active exception"). Importing it
# here binds None instead: spawned ranks import the benchmark's main module, hence this one, before the
# rank function runs, so before any process group exists.
import torch
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


def int_options(parser: argparse.ArgumentParser, **defaults: int) -> argparse.ArgumentParser:
    """Add one integer option per keyword (``min_len=16`` -> ``--min-len``, default 16); returns ``parser``."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    return parser


def mlp(width: int, layers: int) -> torch.nn.Sequential:
    """``layers`` x (Linear(width, width), GELU), initialised from torch's current seed."""
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def mse_step(engine: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    """One training step of a DeepSpeed engine on an MSE loss; returns this rank's loss."""
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def mlp_engine(config: dict, width: int, layers: int, micro: int) -> tuple[Any, Callable[[], float]]:
    """A DeepSpeed engine over ``mlp(width, layers)`` (seed 0: the same weights on every rank) and its training
    step (``mse_step``) on a fixed random batch of ``micro`` rows, seeded by the rank."""
    import torch.distributed as dist

    import deepspeed

    torch.manual_seed(0)
    engine, _, _, _ = deepspeed.initialize(model=mlp(width, layers), config=config)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(micro, width, generator=gen), torch.randn(micro, width, generator=gen)
    return engine, functools.partial(mse_step, engine, x, y)


def timed_ms(step: Callable[[], object], steps: int) -> list[float]:
    """Run ``step`` ``steps`` times on every rank, each started together (barrier); returns each step's time in
    ms on the slowest rank, the time the job as a whole waits."""
    import torch.distributed as dist

    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed) * 1e3)
    return times
