"""The 1-bit optimizers against their plain versions through ``deepspeed.initialize``: wall time per step and
bytes on the wire per step after the freeze, on 2 and 4 gloo ranks (the shared test harness, 1 torch thread per
rank).

Model: an MLP of ``--layers`` x ``Linear(--width, --width)`` + GELU, MSE loss, fp32, micro-batch ``--micro`` per
rank. Adam: the config's ``Adam`` with ``torch_adam`` (gradients all-reduced by the engine, fp32). Lamb: the
config's ``Lamb`` (FusedLamb, all-reduced by the engine). OneBitAdam / OneBitLamb: ``freeze_step`` = ``--warmup``
(full-precision warm-up), then 1-bit compressed momentum every step. ZeroOneAdam: ``var_freeze_step`` =
``--warmup``, then local steps whose interval doubles every step up to 4 (``local_step_scaler`` 1,
``local_step_clipper`` 4): one 1-bit sync per 4 steps, so its median step time is a local step's. Each variant
runs ``--warmup`` untimed steps, then ``--steps`` timed steps (median and mean of the slowest rank's step time; the
ratio is of medians), then 4
steps with the comms logger on to count bytes (``deepspeed.comm``'s message sizes, summed over ops: what this
rank hands to the collectives, per step). Ratios: against Adam (OneBitAdam, ZeroOneAdam) or Lamb (OneBitLamb).
Run: ``hatch run bench:onebit``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _common import int_options, mlp_engine, timed_ms  # noqa: E402


def _rank_run(optimizer: dict, width: int, layers: int, micro: int, warmup: int, steps: int) -> dict:
    import torch.distributed as dist

    from deepspeed import comm

    world = dist.get_world_size()
    config = {"train_batch_size": micro * world, "train_micro_batch_size_per_gpu": micro, "optimizer": optimizer}
    engine, step = mlp_engine(config, width, layers, micro)
    for _ in range(warmup):
        step()
    times = timed_ms(step, steps)
    comm.configure(enabled=True, prof_all=True)
    comm._state.comms_logger.reset()
    for _ in range(4):
        step()
    sent = sum(size * rec.count for _, size, rec in comm._state.comms_logger.rows()) / 4
    comm.configure(enabled=False)
    return {"ms": statistics.median(times), "mean_ms": statistics.fmean(times), "bytes": sent, "loss": step(),
            "params": sum(p.numel() for p in engine.module.parameters())}


def main() -> None:
    from _harness import run_distributed

    ap = int_options(argparse.ArgumentParser(description=__doc__.splitlines()[0]), width=1024, layers=4, micro=8,
                     warmup=5, steps=10)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    variants = {  # name -> (config, baseline name)
        "Adam": ({"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True, "adam_w_mode": False}}, "Adam"),
        "OneBitAdam": ({"type": "OneBitAdam", "params": {"lr": 1e-4, "freeze_step": args.warmup}}, "Adam"),
        "ZeroOneAdam": ({"type": "ZeroOneAdam", "params": {"lr": 1e-4, "var_freeze_step": args.warmup,
                                                           "local_step_scaler": 1, "local_step_clipper": 4}}, "Adam"),
        "Lamb": ({"type": "Lamb", "params": {"lr": 1e-4, "bias_correction": False}}, "Lamb"),
        "OneBitLamb": ({"type": "OneBitLamb", "params": {"lr": 1e-4, "freeze_step": args.warmup}}, "Lamb"),
    }
    print(f"# onebit: {datetime.date.today()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, "
          f"MLP {args.layers}x{args.width}, micro-batch {args.micro}/rank, median of {args.steps} steps")
    print(f"{'ranks':>5} {'optimizer':>11} {'params':>9} {'ms/step':>9} {'mean ms':>9} {'bytes/step':>12} "
          f"{'ms ratio':>9} {'bytes ratio':>12}")
    for world in args.worlds:
        done: dict[str, dict] = {}
        for name, (opt, base) in variants.items():
            r = done[name] = run_distributed(_rank_run, world_size=world, timeout=600,
                                             args=(opt, args.width, args.layers, args.micro, args.warmup,
                                                   args.steps))[0]
            print(f"{world:>5} {name:>11} {r['params']:>9} {r['ms']:>9.2f} {r['mean_ms']:>9.2f} {r['bytes']:>12.0f} "
                  f"{r['ms'] / done[base]['ms']:>9.3f} {r['bytes'] / done[base]['bytes']:>12.4f}")


if __name__ == "__main__":
    main()
