"""MiCS and ZeRO++ against plain ZeRO-3 through ``deepspeed.initialize``: wall time per step and bytes each rank
sends per step through the ZeRO-3 collectives, by kind (``ds_zero.zeropp.traffic``: parameter gathers from the
primary and the hpZ secondary partitions, the gradient reduce-scatter / qgZ all-to-all, MiCS's replica
all-reduce), on 4 gloo ranks (the shared test harness, 1 torch thread per rank).

Model: an MLP of ``--layers`` x ``Linear(--width, --width)`` + GELU, MSE loss, fp32, micro-batch ``--micro`` per
rank, ZeRO-3 with every parameter partitioned and ``stage3_max_reuse_distance`` 0 (backward gathers again, as a
model too large to keep gathered does). Variants: plain; MiCS with shard groups of 2; hpZ with secondary groups
of 2; qwZ; qgZ (2 "nodes" of 2 ranks: LOCAL_WORLD_SIZE=2, both hops); qwZ + qgZ + LoCo. Each runs ``--warmup``
untimed steps, then ``--steps`` timed steps (median of the slowest rank's step time); bytes are this rank's
(rank 0) per timed step. On one machine loopback gloo moves bytes almost for free, so the time column shows
what quantization costs on CPU, not what it saves on a slow link; the bytes column is what a link would carry.
Run: ``hatch run bench:zeropp``.
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

VARIANTS = {
    "plain": {},
    "MiCS 2": {"mics_shard_size": 2},
    "hpZ 2": {"zero_hpz_partition_size": 2},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "qwZ+qgZ+LoCo": {"zero_quantized_weights": True, "zero_quantized_gradients": True,
                     "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}},
}


def _rank_run(zero: dict, width: int, layers: int, micro: int, warmup: int, steps: int) -> dict:
    import torch.distributed as dist

    from ds_zero.zeropp import traffic

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # two ranks per "node": qgZ's and hpZ's groups
    world = dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": micro, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0, **zero}}
    _, step = mlp_engine(config, width, layers, micro)
    for _ in range(warmup):
        step()
    traffic.reset()
    times = timed_ms(step, steps)
    sent = {k: v / steps for k, v in traffic.sent_bytes().items()}
    return {"ms": statistics.median(times), "bytes": sent, "loss": step(), "world": world}


def main() -> None:
    from _harness import run_distributed

    ap = int_options(argparse.ArgumentParser(description=__doc__.splitlines()[0]), width=512, layers=4, micro=8,
                     warmup=3, steps=10)
    args = ap.parse_args()
    print(f"# zeropp: {datetime.date.today()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, 4 ranks, "
          f"MLP {args.layers}x{args.width}, micro-batch {args.micro}/rank, median of {args.steps} steps")
    print(f"{'variant':>13} {'ms/step':>9} {'gather B':>10} {'2nd gather B':>12} {'reduce B':>10} {'replica B':>10} "
          f"{'total B':>10} {'ms ratio':>9} {'B ratio':>8} {'loss':>8}")
    base = None
    for name, zero in VARIANTS.items():
        r = run_distributed(_rank_run, world_size=4, timeout=600,
                            args=(zero, args.width, args.layers, args.micro, args.warmup, args.steps))[0]
        b = r["bytes"]
        total = sum(b.values())
        base = base or (r["ms"], total)
        print(f"{name:>13} {r['ms']:>9.2f} {b.get('param_gather', 0):>10.0f} "
              f"{b.get('param_gather_secondary', 0):>12.0f} {b.get('grad_reduce', 0):>10.0f} "
              f"{b.get('grad_replica', 0):>10.0f} {total:>10.0f} {r['ms'] / base[0]:>9.3f} {total / base[1]:>8.3f} "
              f"{r['loss']:>8.4f}")


if __name__ == "__main__":
    main()
