"""Block-sparse attention (``deepspeed.ops.sparse_attention``) against dense SDPA and the masked dense reference.

Workload: ``--batch`` x ``--heads`` x ``--seq`` x ``--head-dim`` fp32 query/key/value, forward plus backward of
``(out * w).sum()`` (w fixed random), gradients of query, key and value. Layouts: Fixed (``--block``,
``--local-blocks`` local window, one global block per window, bidirectional) and, for comparison, DeepSpeed's
default Fixed (block 16, 4 local blocks).

Variants:
- ``sdpa``: ``F.scaled_dot_product_attention`` without a mask (dense attention, the baseline of the ratios);
- ``masked``: ``masked_dense_attention``, the plain reference (dense scores, dropped blocks masked: what
  ``SparseSelfAttention`` computed before);
- ``sparse``: ``SparseSelfAttention`` (``block_sparse_attention``: only the layout's blocks).

1. Correctness: outputs and query/key/value gradients of ``sparse`` against ``masked`` (max abs difference).
2. Peak memory: bytes allocated by torch's CPU allocator during one forward + backward beyond what was allocated
   before (the profiler's allocation events carry the allocator's running total), each variant in a fresh
   subprocess so that nothing else is alive.
3. Time: ``--reps`` repetitions, each timing one iteration of every variant in rotating order (drifting load hits
   all alike), once with torch's default thread count (wall ms, and process CPU ms, which shows time spent
   spinning in thread hand-offs) and once with one torch thread (wall and CPU ms). Ratios are medians of
   per-repetition ratios to ``sdpa``.
4. Ops: aten operator calls per step (profiler), the number of thread hand-offs a step pays for.

Run: ``python benchmarks/sparse_attention.py`` (``--quick``: L = 1024, fewer repetitions).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from _common import cpu_model, int_options

from ds_ops.sparse_attention import FixedSparsityConfig, SparseSelfAttention, layout_to_token_mask
from ds_ops.sparse_attention import masked_dense_attention as masked_dense
from ds_ops.sparse_attention.block_sparse import DEFAULT_CHUNK_ELEMENTS

VARIANTS = ("sdpa", "masked", "sparse")


def _inputs(args):
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    qkv = [torch.randn(shape, generator=gen).requires_grad_() for _ in range(3)]
    return qkv, torch.randn(shape, generator=gen)


def _layouts(args):
    """(name, config) for the layouts measured: the chosen Fixed one and DeepSpeed's default Fixed."""
    chosen = FixedSparsityConfig(args.heads, block=args.block, num_local_blocks=args.local_blocks)
    default = FixedSparsityConfig(args.heads)
    return [(f"Fixed block {args.block}, {args.local_blocks} local", chosen),
            ("Fixed default (block 16, 4 local)", default)]


def _variant(name, config, args):
    """A function of (q, k, v) -> attention output."""
    if name == "sdpa":
        return F.scaled_dot_product_attention
    if name == "sparse":
        module = SparseSelfAttention(config, max_seq_length=args.seq)
        module.chunk_elements = args.chunk_elements
        return module
    token_mask = layout_to_token_mask(config.make_layout(args.seq), config.block)
    scale = args.head_dim ** -0.5
    return lambda q, k, v: masked_dense(q, k, v, token_mask, scale)


def _step(fn, qkv, weight):
    for t in qkv:
        t.grad = None
    out = fn(*qkv)
    (out * weight).sum().backward()
    return out.detach(), [t.grad for t in qkv]


def _peak_bytes(fn, qkv, weight) -> int:
    """Peak of torch's CPU allocator total during one step, relative to its start."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    totals = [0]

    def walk(events):
        for e in events:
            if e.tag == _EventType.Allocation:
                totals.append(e.extra_fields.total_allocated)
            walk(e.children)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(fn, qkv, weight)
    walk(prof.profiler.kineto_results.experimental_event_tree())
    return max(totals)


def _child(args) -> None:
    """``--child-memory LAYOUT VARIANT``: print the peak bytes of one variant (fresh process)."""
    layout_index, name = args.child_memory
    config = _layouts(args)[int(layout_index)][1]
    qkv, weight = _inputs(args)
    fn = _variant(name, config, args)
    _step(fn, qkv, weight)  # warm up: plans, caches, lazy inits are not part of a step's peak
    print(json.dumps({"peak": _peak_bytes(fn, qkv, weight)}))


def _memory(args, layout_index: int, name: str) -> int:
    cmd = [sys.executable, __file__, "--child-memory", str(layout_index), name, *_size_args(args)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak"]


def _size_args(args):
    return ["--batch", str(args.batch), "--heads", str(args.heads), "--seq", str(args.seq), "--head-dim",
            str(args.head_dim), "--block", str(args.block), "--local-blocks", str(args.local_blocks),
            "--chunk-elements", str(args.chunk_elements)]


def _times(fns, qkv, weight, reps):
    """({variant: [wall ms]}, {variant: [CPU ms]}), variants in rotating order within each repetition."""
    names = list(fns)
    wall, cpu = {n: [] for n in names}, {n: [] for n in names}
    for rep in range(reps):
        for i in range(len(names)):
            name = names[(rep + i) % len(names)]
            start, start_cpu = time.perf_counter(), time.process_time()
            _step(fns[name], qkv, weight)
            wall[name].append((time.perf_counter() - start) * 1e3)
            cpu[name].append((time.process_time() - start_cpu) * 1e3)
    return wall, cpu


def _op_count(fn, qkv, weight) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(fn, qkv, weight)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def _ratio(num, den):
    return statistics.median(n / d for n, d in zip(num, den, strict=True))


def _density(config, seq):
    layout = config.make_layout(seq)
    return float(layout.bool().float().mean())


def main() -> None:
    parser = int_options(argparse.ArgumentParser(description=__doc__.splitlines()[0]), batch=1, heads=4,
                         seq=4096, head_dim=64, block=32, local_blocks=8, reps=5,
                         chunk_elements=DEFAULT_CHUNK_ELEMENTS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child-memory", nargs=2, metavar=("LAYOUT", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.seq, args.reps = 1024, 3
    if args.child_memory:
        _child(args)
        return

    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.UTC)
    qkv, weight = _inputs(args)
    rows = []
    for index, (label, config) in enumerate(_layouts(args)):
        fns = {name: _variant(name, config, args) for name in VARIANTS}
        ref_out, ref_grads = _step(fns["masked"], qkv, weight)
        out, grads = _step(fns["sparse"], qkv, weight)
        err = max(float((a - b).abs().max()) for a, b in zip([out, *grads], [ref_out, *ref_grads], strict=True))
        peaks = {name: _memory(args, index, name) for name in VARIANTS}
        ops = {name: _op_count(fn, qkv, weight) for name, fn in fns.items()}
        timings = [_times(fns, qkv, weight, args.reps)]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        timings.append(_times(fns, qkv, weight, args.reps))
        torch.set_num_threads(threads)
        rows.append((label, _density(config, args.seq), err, peaks, ops, timings))

    load_after = os.getloadavg()
    print(f"# {started:%Y-%m-%d %H:%M} UTC, {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), Python {platform.python_version()}")
    print(f"# load average (1, 5, 15 min) before {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, "
          f"after {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}")
    threads = torch.get_num_threads()
    print(f"# B={args.batch} H={args.heads} L={args.seq} D={args.head_dim} fp32, forward + backward, "
          f"{args.reps} interleaved reps per thread count, medians; sparse chunk_elements={args.chunk_elements}")
    print(f"\n| layout | density | variant | peak MiB | x sdpa | aten calls | wall ms {threads}T | x sdpa "
          f"| CPU ms {threads}T | x sdpa | wall ms 1T | x sdpa | CPU ms 1T | x sdpa | max abs diff vs masked |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, density, err, peaks, ops, timings in rows:
        for name in VARIANTS:
            cells = [label, f"{density:.3f}", name, f"{peaks[name] / 2**20:.1f}",
                     f"{peaks[name] / peaks['sdpa']:.2f}", str(ops[name])]
            for per_variant in (t for pair in timings for t in pair):
                cells += [f"{statistics.median(per_variant[name]):.0f}",
                          f"{_ratio(per_variant[name], per_variant['sdpa']):.2f}"]
            cells.append(f"{err:.1e}" if name == "sparse" else "")
            print("| " + " | ".join(cells) + " |")
    for label, _, _, peaks, _, timings in rows:
        (wall, _), (wall1, cpu1) = timings
        print(f"# {label}: sparse vs masked reference: memory {peaks['sparse'] / peaks['masked']:.2f}x, wall "
              f"{_ratio(wall['sparse'], wall['masked']):.2f}x ({threads}T), "
              f"{_ratio(wall1['sparse'], wall1['masked']):.2f}x (1T), "
              f"CPU {_ratio(cpu1['sparse'], cpu1['masked']):.2f}x (1T)")


if __name__ == "__main__":
    main()
