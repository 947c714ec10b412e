"""Start-up cost of the distributed test harness (tests/_harness) against plain torch.multiprocessing.spawn.

Every multi-rank test pays the harness's start-up, so this measures, for 1, 2 and 4 ranks, the wall time of
one trivial test (init gloo group, one all_reduce, tear down):

* baseline: ``torch.multiprocessing.spawn`` of N fresh processes (each imports torch), as a test written
  without the harness would do;
* cold: the first ``run_distributed`` call of a fresh interpreter (torch already imported in the test
  process, as after pytest's collection), per start method (forkserver is the harness default);
* warm: a later call, reusing the pooled workers (median of ``--warm-iters`` calls).

Ratios are baseline / harness (higher is better). Run: ``python benchmarks/harness_startup.py``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

TESTS_DIR = str(Path(__file__).resolve().parents[1] / "tests")
sys.path.insert(0, TESTS_DIR)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402
from _harness import run_distributed, shutdown_pool  # noqa: E402
from _harness._runner import _free_port  # noqa: E402

METHODS = ("forkserver", "spawn", "fork")


def _all_reduce() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _spawn_entry(rank: int, world_size: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    _all_reduce()
    dist.destroy_process_group()


def time_spawn_baseline(n: int) -> float:
    start = time.perf_counter()
    tmp.spawn(_spawn_entry, args=(n, _free_port()), nprocs=n, join=True)
    return time.perf_counter() - start


def time_cold(n: int, method: str) -> float:
    """First harness call of a fresh interpreter, measured inside it (its own imports excluded)."""
    env = {**os.environ, "DS_TEST_START_METHOD": method}
    out = subprocess.run(
        [sys.executable, __file__, "--cold-child", str(n)], env=env, capture_output=True, text=True, check=True
    ).stdout
    return float(out.strip().splitlines()[-1])


def time_warm(n: int, iters: int) -> float:
    run_distributed(_all_reduce, n)  # start (or reuse) the workers
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        run_distributed(_all_reduce, n)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _median(fn, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3, help="runs per cold/baseline figure (median)")
    parser.add_argument("--warm-iters", type=int, default=20)
    parser.add_argument("--cold-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cold_child:
        start = time.perf_counter()
        run_distributed(_all_reduce, args.cold_child)
        print(time.perf_counter() - start)
        return
    rows = []
    for n in args.ranks:
        base = _median(lambda n=n: time_spawn_baseline(n), args.repeats)
        cold = {m: _median(lambda n=n, m=m: time_cold(n, m), args.repeats) for m in METHODS}
        warm = time_warm(n, args.warm_iters)
        rows.append((n, base, cold, warm))
    shutdown_pool()
    _print(rows, args)


def _print(rows: list, args: argparse.Namespace) -> None:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"harness start-up  | {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} | "
          f"cores {os.cpu_count()} | load avg {load:.1f} | torch {torch.__version__} | "
          f"Python {platform.python_version()} | median of {args.repeats} (cold, baseline), {args.warm_iters} (warm)")
    head = ["ranks", "mp.spawn s"] + [f"cold {m} s" for m in METHODS] + ["warm ms", "spawn/cold", "spawn/warm"]
    print(" | ".join(f"{h:>15}" for h in head))
    for n, base, cold, warm in rows:
        cells = [str(n), f"{base:.2f}"] + [f"{cold[m]:.2f}" for m in METHODS]
        cells += [f"{warm * 1e3:.1f}", f"{base / cold['forkserver']:.1f}x", f"{base / warm:.0f}x"]
        print(" | ".join(f"{c:>15}" for c in cells))


if __name__ == "__main__":
    main()
