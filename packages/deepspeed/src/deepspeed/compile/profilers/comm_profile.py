"""All-gather cost model for the prefetch pass.

``create_predictor()`` times ``all_gather_into_tensor`` once per engine over message sizes 2**1 .. 2**(max_exp-1)
bytes-per-world elements, then answers "how long does gathering N bytes take" by linear interpolation between the
measured points (and linear extrapolation past the largest; on the host the sweep stops early, see
``HOST_STOP_SECONDS``). Every rank takes part in every collective in the same
order; a rank that cannot allocate the next size makes all of them stop there (one vote per size).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

from ..state import active_state
from .graph_profile import current_device, timing_events

# Largest message tried is 2**(exp-1) elements per rank-world; the host stops lower (memory copies through gloo are
# slow and beyond 16M elements the line is already straight).
MAX_EXP_DEVICE = 31
MAX_EXP_HOST = 25
# On the host the sweep also stops after the first size whose all-gather takes longer than this (seconds, averaged
# over ranks, so every rank stops at the same size): gloo is well into its straight line by then, and the larger
# sizes would take minutes. The prediction extends the last measured segment.
HOST_STOP_SECONDS = 0.002


def sync_all() -> None:
    get_accelerator().synchronize()
    dist.barrier()


def get_bw(comm_op: str, size: float, duration: float) -> tuple[float, float]:
    """Algorithm and bus bandwidth (bytes/s) of ``comm_op`` moving ``size`` bytes per rank in ``duration`` s."""
    if duration <= 0:
        raise ValueError(f"get_bw: duration must be > 0 seconds, got {duration}")
    n = dist.get_world_size()
    if comm_op == "all_gather":
        size *= n
        return size / duration, size / duration * (n - 1) / n
    if comm_op == "all_to_all":
        return size / duration, size / duration * (n - 1) / n
    if comm_op == "all_reduce":
        return 2 * size / duration, size / duration * 2 * (n - 1) / n
    if comm_op in ("pt2pt", "broadcast"):
        return size / duration, size / duration
    raise ValueError(f"get_bw: comm_op {comm_op!r} is not one of all_gather, all_to_all, all_reduce, pt2pt, broadcast")


def timed_all_gather(device: torch.device, input: torch.Tensor, output: torch.Tensor, start_event, end_event,
                     warmup: int, trials: int, async_op: bool) -> tuple[int, float]:
    """(bytes gathered, mean seconds per all-gather averaged over ranks)."""
    sync_all()
    for _ in range(warmup):
        dist.all_gather_into_tensor(output, input, async_op=async_op)
    sync_all()
    start_event.record()
    for _ in range(trials):
        dist.all_gather_into_tensor(output, input, async_op=async_op)
    end_event.record()
    sync_all()
    seconds = torch.tensor([start_event.elapsed_time(end_event) / 1000 / trials], device=device)
    world = dist.get_world_size()
    if world > 1:
        dist.all_reduce(seconds, dist.ReduceOp.SUM)
        seconds /= world
    return input.element_size() * input.numel() * world, float(seconds.item())


def _allocate(n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Input and output buffers for one size, or None on every rank if any rank ran out of memory."""
    buffers, failed = None, 0
    try:
        inp = torch.full((n, ), float(dist.get_rank()), dtype=dtype, device=device)
        buffers = inp, torch.empty(n * dist.get_world_size(), dtype=dtype, device=device)
    except torch.OutOfMemoryError:
        failed = 1
    flag = torch.tensor([failed], device=device)
    dist.all_reduce(flag, dist.ReduceOp.MAX)
    return buffers if int(flag.item()) == 0 else None


def run_all_gather(device: torch.device, dtype: torch.dtype, maxsize: int, warmup: int = 5, trials: int = 10,
                   async_op: bool = False, stop_seconds: float | None = None) -> list[tuple[int, float]]:
    """Measured ``(bytes, seconds)`` points, starting with (0, 0), for sizes 2**1 .. 2**(maxsize-1) per world;
    with ``stop_seconds``, none after the first size taking longer than that."""
    world = dist.get_world_size()
    start, end = timing_events(device, 1)[0], timing_events(device, 1)[0]
    results = [(0, 0.0)]
    sync_all()
    for per_rank in (2**p // world for p in range(1, maxsize)):
        if per_rank == 0:
            continue
        buffers = _allocate(per_rank, dtype, device)
        if buffers is None:
            if dist.get_rank() == 0:
                print(f"all-gather profile stopped at {per_rank} elements per rank: out of memory")
            break
        results.append(timed_all_gather(device, *buffers, start, end, warmup, trials, async_op))
        del buffers
        if stop_seconds is not None and results[-1][1] > stop_seconds and len(results) > 2:
            break
    return results


def _interpolate(points: list[tuple[int, float]]) -> Callable[[float], float]:
    sizes = [s for s, _ in points]
    times = [t for _, t in points]

    def predict(size: float) -> float:
        if size <= 0:
            return 0.0
        i = min(max(bisect_left(sizes, size), 1), len(sizes) - 1)  # segment [i-1, i]; the last one extends
        s0, s1, t0, t1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
        return t0 + (t1 - t0) * (size - s0) / (s1 - s0)

    return predict


def __getattr__(name: str) -> Any:
    # ``profile_results``: the active engine's measured points (DeepSpeed's module-level name)
    if name == "profile_results":
        return active_state().comm_profile
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def create_predictor() -> Callable[[float], float]:
    """Seconds an all-gather of ``size`` bytes takes here (0 for size 0), measured once per engine (kept in its
    ``compile.state``: every rank's engine is new together, so every rank measures, or reuses, alike)."""
    state = active_state()
    if state.comm_profile is None:
        device = current_device()
        max_exp = MAX_EXP_HOST if device.type == "cpu" else MAX_EXP_DEVICE
        with unset_fake_temporarily():
            state.comm_profile = run_all_gather(device, torch.bfloat16, max_exp,
                                                stop_seconds=HOST_STOP_SECONDS if device.type == "cpu" else None)
        if dist.get_rank() == 0:
            for size, seconds in state.comm_profile:
                print(f"all-gather profile: {size} bytes {seconds:.6f} s")
    if len(state.comm_profile) < 2:
        raise RuntimeError("all-gather profile has no measured size (out of memory at the smallest one)")
    return _interpolate(state.comm_profile)
