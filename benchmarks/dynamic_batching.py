"""Dynamic batching (``data_efficiency.data_sampling.dynamic_batching``): how full the token budget gets, against
the fixed micro batch that is safe for the longest sequence (the baseline), and how long packing takes.

Sequence lengths are drawn uniformly from ``--min-len``..``--max-len`` (seed 0); the baseline micro batch holds
``max_tokens // max_len`` samples (it never exceeds the budget, whatever the lengths). "budget used" is the mean
over micro batches of (sum of sequence lengths) / max_tokens; "samples/mb" the mean micro-batch size.

    python benchmarks/dynamic_batching.py                       # 100k samples, lengths 16..512, 4096 tokens
    python benchmarks/dynamic_batching.py --samples 20000 --max-tokens 2048
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import time

import numpy as np
import torch
from _common import int_options

from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import batch_by_seqlens


def _row(name: str, lengths: np.ndarray, max_tokens: int, seconds: float, batches: list[list[int]],
         baseline_used: float) -> str:
    used = float(np.mean([lengths[ids].sum() for ids in batches])) / max_tokens
    samples = float(np.mean([len(ids) for ids in batches]))
    return (f"| {name} | {len(batches)} | {samples:.1f} | {used:.3f} | {used / baseline_used:.2f}x | "
            f"{seconds:.2f} s |")


def main() -> None:
    parser = int_options(argparse.ArgumentParser(description=__doc__.splitlines()[0]), samples=100_000, min_len=16,
                         max_len=512, max_tokens=4096)
    parser.add_argument("--effective-batch", type=int, default=8, help="micro batches per optimizer step")
    args = parser.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    lengths = np.random.default_rng(0).integers(args.min_len, args.max_len + 1, size=args.samples)
    fixed = args.max_tokens // args.max_len
    baseline = [list(range(i, i + fixed)) for i in range(0, len(lengths) - fixed + 1, fixed)]
    baseline_used = float(np.mean([lengths[ids].sum() for ids in baseline])) / args.max_tokens
    print(f"# {os.cpu_count()} cores, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"# {args.samples} samples, lengths {args.min_len}..{args.max_len}, max_tokens {args.max_tokens}, "
          f"effective batch {args.effective_batch} micro batches")
    print("| packing | micro batches | samples/mb | budget used | vs fixed | packing time |")
    print("|---|---|---|---|---|---|")
    print(f"| fixed micro batch of {fixed} (baseline) | {len(baseline)} | {fixed:.1f} | {baseline_used:.3f} | "
          "1.00x | - |")
    for name, kwargs in (("dynamic, dataloader order", {"sequence_picking_order": "dataloader"}),
                         ("dynamic, random order", {"sequence_picking_order": "random", "seed": 1}),
                         ("dynamic, seqlen order", {"sequence_picking_order": "seqlen"}),
                         ("dynamic, equal-size (pipeline)", {"required_microbatches_of_same_size": True})):
        start = time.perf_counter()
        mbs, _, _ = batch_by_seqlens(lengths, args.max_tokens, effective_batch_size=args.effective_batch, **kwargs)
        print(_row(name, lengths, args.max_tokens, time.perf_counter() - start, [ids for _, ids in mbs],
                   baseline_used))


if __name__ == "__main__":
    main()
