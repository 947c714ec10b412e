"""DeepCompile's default ZeRO-3 schedule (``zero3_compile``, then ``zero3_compile`` + ``prefetch`` +
``selective_gather`` from step 5, as DeepSpeed's) on 2 gloo ranks, repeated: does it finish every time, and are
the losses and weights bitwise those of the same training compiled with ``zero3_compile`` alone?

Model: three linear layers (8 -> ``--hidden`` -> ``--hidden`` -> 4) with a graph break after the first (two
compiled graphs, so ``selective_gather`` plans on the last backward graph), Adam, ``--steps`` steps (past step 5,
where the planning passes switch on and every graph is recompiled and profiled), batch 2 per rank, fp32, eager
backend, ``engine.compile()``. Each rank sleeps a random 0-20 ms before each step (jittered timing). Each run is one
2-rank ``run_distributed`` call in the shared harness's reused worker processes (so engines of earlier runs lived
in the same processes). Baseline: the same training with ``schedule=[(0, ["zero3_compile"])]``, run first.

Per run: wall seconds; "losses" and "weights" equal (bitwise) to the baseline's; the number of prefetch groups and
persistent parameters the passes chose (rank 0). Before the fix the default schedule stalled in about half the runs
(a GIL / gloo work-queue deadlock in the profiling collectives, see ``deepspeed/compile/comm_guard.py``).

Run: ``python benchmarks/deepcompile_prefetch_repeat.py`` (``--runs 10 --steps 8``).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import sys
import time
from pathlib import Path

TESTS_DIR = str(Path(__file__).resolve().parents[1] / "tests")
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

import torch  # noqa: E402
from _harness import run_distributed, shutdown_pool  # noqa: E402


class _Net(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, hidden)
        self.hidden = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        torch._dynamo.graph_break()
        h = torch.tanh(self.hidden(h)) + h
        return self.out(h)


def train(steps: int, hidden: int, default_schedule: bool, jitter: bool) -> dict:
    """One rank's training; returns its losses, a digest of its final weight partitions and what the passes chose."""
    import random

    import torch.distributed as dist

    import deepspeed
    from deepspeed.compile.util import get_deepcompile_handle

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3}, "compile": {"deepcompile": True}}
    engine, *_ = deepspeed.initialize(model=_Net(hidden), config=config)
    engine.compile(backend="eager", schedule=None if default_schedule else [(0, ["zero3_compile"])])
    data = torch.Generator().manual_seed(1 + dist.get_rank())
    pause = random.Random()  # unseeded: the timing differs run to run
    losses = []
    try:
        for _ in range(steps):
            if jitter:
                time.sleep(pause.uniform(0.0, 0.02))
            loss = engine(torch.randn(2, 8, generator=data)).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().clone())
        handle = get_deepcompile_handle()
        persistent = sum(1 for p in handle.params.values() if p.persistent)
        digest = hashlib.sha256()
        for p in engine.module.parameters():
            digest.update(p.ds_tensor.detach().contiguous().numpy().tobytes())
        loss_bytes = torch.stack(losses).numpy().tobytes()
    finally:
        engine.destroy()
    return {"losses": loss_bytes, "weights": digest.hexdigest(), "persistent": persistent,
            "last_loss": float(losses[-1])}


def run_once(steps: int, hidden: int, default_schedule: bool, jitter: bool, timeout: float) -> tuple[list, float]:
    start = time.perf_counter()
    ranks = run_distributed(train, world_size=2, args=(steps, hidden, default_schedule, jitter), timeout=timeout)
    return ranks, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (the passes switch on at 5)")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it counts as a stall")
    parser.add_argument("--no-jitter", action="store_true")
    args = parser.parse_args()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, 2 gloo ranks, {args.steps} steps, "
          f"hidden {args.hidden}, jitter {'off' if args.no_jitter else '0-20 ms'}")
    try:
        baseline, base_s = run_once(args.steps, args.hidden, False, not args.no_jitter, args.timeout)
        print(f"baseline (zero3_compile only): {base_s:.1f} s, last loss rank0 {baseline[0]['last_loss']:.6f}")
        print(f"{'run':>4} {'wall s':>7} {'losses==base':>13} {'weights==base':>14} {'persistent':>10}")
        failures = 0
        for i in range(args.runs):
            ranks, seconds = run_once(args.steps, args.hidden, True, not args.no_jitter, args.timeout)
            same_loss = all(r["losses"] == b["losses"] for r, b in zip(ranks, baseline, strict=True))
            same_weights = all(r["weights"] == b["weights"] for r, b in zip(ranks, baseline, strict=True))
            failures += not (same_loss and same_weights)
            print(f"{i + 1:>4} {seconds:>7.1f} {str(same_loss):>13} {str(same_weights):>14} "
                  f"{ranks[0]['persistent']:>10}", flush=True)
    finally:
        shutdown_pool()
    print(f"{args.runs} runs finished; {args.runs - failures} bitwise equal to the baseline")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
