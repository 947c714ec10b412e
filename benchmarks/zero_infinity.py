"""ZeRO-Infinity: a model whose Adam model states (bf16 weights + fp32 masters + exp_avg + exp_avg_sq, 14 bytes
per parameter) are about 4 GB, trained 3 steps on 2 gloo ranks with everything in memory (ZeRO-3) and with
everything on NVMe (``offload_optimizer`` and ``offload_param`` ``device: nvme``, a directory on local disk).

Each configuration runs in fresh rank processes (so peak RSS is the run's own): the model is built under
``deepspeed.zero.Init`` (``remote_device="nvme"`` for the NVMe runs, so no rank ever holds the whole model),
then 3 steps of a stack of ``--layers`` bias-free ``Linear(--width)`` layers on random data. Reported per rank:
peak RSS (``VmHWM``, whole process) and its growth over the RSS before the model was built, and the mean time
of steps 2-3 (step 1 creates the optimizer states; ``nvme-seq`` runs 2 steps). The ranks run with glibc's
``M_MMAP_THRESHOLD`` fixed at 1 MiB (``--malloc-mmap-threshold``): its default grows up to 32 MiB once large
blocks are freed, and the heap then keeps freed multi-MiB tensors resident, so peak RSS would count memory no
tensor holds (in both runs alike; 0 measures with the default). Two NVMe runs: ``nvme`` with ``pipeline_read`` and
``pipeline_write`` (the configuration to use) and ``nvme-seq`` without pipelining, whose optimizer-swap waits
are pure I/O (nothing overlaps them): the bytes / seconds blocked of its last (steady-state) step's optimizer
swaps, per direction, are the achieved swap bandwidth, set against ``benchmarks/aio.py``'s ``ours_run`` (locked
buffers, same block size / queue depth / threads) measured in this run on the same disk, once by one process
alone and once by ``WORLD`` processes at the same time (as the ranks swap): per rank against the latter is the
like-for-like figure. The gradient file's piecewise writes and reads during backward are reported apart.

    python benchmarks/zero_infinity.py                       # ~4 GB of states (68 x 2048^2), /tmp/zero_infinity
    python benchmarks/zero_infinity.py --layers 8 --nvme-path /mnt/nvme   # quick / another disk
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_model, spawn_ranks  # noqa: E402

WORLD = 2


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _config(args: argparse.Namespace, mode: str) -> dict:
    layer = args.width * args.width  # the same ZeRO-3 knobs in every run: a few layers live at a time
    zero = {"stage": 3, "sub_group_size": args.sub_group, "stage3_prefetch_bucket_size": 2 * layer,
            "stage3_max_live_parameters": 4 * layer, "stage3_max_reuse_distance": 0,
            "stage3_param_persistence_threshold": 0, "reduce_bucket_size": layer}
    if mode != "memory":
        pipe = mode == "nvme"
        part = args.width * args.width // WORLD
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": args.nvme_path, "pipeline_read": pipe,
                                     "pipeline_write": pipe, "buffer_count": 12 if pipe else 4, "fast_init": True}
        zero["offload_param"] = {"device": "nvme", "nvme_path": args.nvme_path, "max_in_cpu": 0,
                                 "buffer_count": 4, "buffer_size": part}
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9, "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
            "aio": {"block_size": args.block_size, "queue_depth": args.queue_depth, "thread_count": args.threads}}


def rank_main(rank: int, payload: tuple, port: int, queue) -> None:
    import deepspeed

    args, mode = payload
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    config = _config(args, mode)
    base = _status("VmRSS")
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, remote_device="nvme" if mode != "memory" else None):
        model = torch.nn.Sequential()
        for _ in range(args.layers):  # appended one by one: each is partitioned as it joins the model
            model.append(torch.nn.Linear(args.width, args.width, bias=False))
    engine = deepspeed.initialize(model=model, config=config)[0]
    times = []
    gen = torch.Generator().manual_seed(rank)
    steps = 2 if mode == "nvme-seq" else 3  # nvme-seq measures bandwidth: 2 steps are enough
    for k in range(steps):
        x = torch.randn(args.batch, args.width, generator=gen, dtype=torch.bfloat16)
        swapper = engine.optimizer.swapper
        if k == steps - 1 and swapper is not None:  # bandwidth of the steady state: the last step's swaps only
            swapper.stats.reset()
        start = time.perf_counter()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    swapper = engine.optimizer.swapper
    stats = swapper.stats.as_dict() if swapper is not None else {}
    row = {"rank": rank, "peak": _status("VmHWM"), "base": base, "step": statistics.mean(times[1:]),
           "optimizer": type(engine.optimizer.optimizer).__name__,
           "loss": float(loss.detach()), **stats}
    engine.destroy()
    rows = [None] * WORLD
    dist.all_gather_object(rows, row)
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _aio_baseline(args: argparse.Namespace, tag: str = "", sync=None) -> dict[str, float]:
    """benchmarks/aio.py's own measurement (``ours_run``: locked buffer, same handle settings; a write is of a
    fresh file and ends with an fsync, a read starts from an evicted page cache), median of 3, bytes/s.
    ``sync``: called before each run, so concurrent processes measure at the same time."""
    import aio as aio_bench

    from ds_ops.aio import AsyncIOHandle

    path = os.path.join(args.nvme_path, f"aio_baseline{tag}.bin")
    out: dict[str, list[float]] = {"write_fresh": [], "read": []}
    with AsyncIOHandle(block_size=args.block_size, queue_depth=args.queue_depth, thread_count=args.threads) as h:
        # at least 64 MiB per request, so that the fsync aio.py adds to a write is not the whole figure
        buf = h.new_cpu_locked_tensor(max(args.sub_group * 4, 64 << 20), torch.uint8).fill_(1)
        for op in out:
            for _ in range(3):
                if sync is not None:
                    sync()
                out[op].append(aio_bench.ours_run(h, buf, path, op)[0])
        h.free_cpu_locked_tensor(buf)
    os.unlink(path)
    return {op: statistics.median(v) for op, v in out.items()}


def baseline_rank(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    """``_aio_baseline`` on ``WORLD`` processes at once (barrier before each run), as the ranks swap."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    row = _aio_baseline(args, f"-{rank}", dist.barrier)
    rows = [None] * WORLD
    dist.all_gather_object(rows, row)
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=68)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--sub-group", type=int, default=2_000_000, help="sub_group_size (elements)")
    p.add_argument("--nvme-path", default="/tmp/zero_infinity")
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--modes", default="memory,nvme,nvme-seq")
    p.add_argument("--malloc-mmap-threshold", type=int, default=1 << 20,
                   help="glibc M_MMAP_THRESHOLD of the ranks (0: glibc's dynamic default)")
    return p.parse_args()


def main() -> None:
    args = _args()
    os.makedirs(args.nvme_path, exist_ok=True)
    if args.malloc_mmap_threshold:  # inherited by the spawned ranks, which read it at start
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    numel = args.layers * args.width * args.width
    print(f"# ZeRO-Infinity, {datetime.date.today()}, {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"# {args.layers} x Linear({args.width}): {numel / 1e6:.0f}M parameters, bf16 + fp32 Adam states "
          f"{numel * 14 / 1e9:.2f} GB, {WORLD} gloo ranks, nvme_path {args.nvme_path}, "
          f"MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold or 'glibc default'}")
    baseline = _aio_baseline(args)
    concurrent = spawn_ranks(baseline_rank, args, WORLD)
    baseline.update({f"{op}_concurrent": statistics.mean(r[op] for r in concurrent) for op in ("write_fresh", "read")})
    results = {}
    for mode in args.modes.split(","):
        start = time.perf_counter()
        results[mode] = spawn_ranks(rank_main, (args, mode), WORLD)
        print(f"# {mode}: {time.perf_counter() - start:.0f} s", flush=True)
    _report(args, results, baseline)
    shutil.rmtree(os.path.join(args.nvme_path, "zero_stage_3"), ignore_errors=True)


def _report(args: argparse.Namespace, results: dict, baseline: dict[str, float]) -> None:
    mem = results.get("memory")
    print("\n| run | rank | optimizer | peak RSS (MiB) | vs memory | RSS growth (MiB) | vs memory | step (s) "
          "| vs memory |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, rows in results.items():
        for r in rows:
            ref = mem[r["rank"]] if mem else None
            grow = r["peak"] - r["base"]
            print(f"| {mode} | {r['rank']} | {r['optimizer']} | {r['peak'] / 2**20:.0f} | "
                  f"{_ratio(r['peak'], ref and ref['peak'])} | "
                  f"{grow / 2**20:.0f} | {_ratio(grow, ref and ref['peak'] - ref['base'])} | {r['step']:.2f} | "
                  f"{_ratio(r['step'], ref and ref['step'])} |")
    seq = results.get("nvme-seq")
    if seq:
        _report_bandwidth(args, seq, baseline)


def _report_bandwidth(args: argparse.Namespace, seq: list[dict], baseline: dict[str, float]) -> None:
    mib = args.sub_group * 4 / 2**20
    print(f"\nswap bandwidth (nvme-seq, last step; block {args.block_size >> 10} KiB, qd {args.queue_depth}, "
          f"threads {args.threads} for both). Swaps move one {mib:.1f} MiB file per tensor (sub_group_size x 4 B), "
          f"rewritten in place, no fsync; aio.py writes a fresh {max(mib, 64):.0f} MiB file + fsync and reads it "
          f"cold. 'aio.py x{WORLD}' = {WORLD} processes at once, per process (like-for-like with per rank); "
          "'aio.py x1' = one process alone (like-for-like with the ranks' sum, when the disk is the limit).")
    print(f"| direction | per rank (MB/s) | aio.py x{WORLD} (MB/s) | per rank / aio.py x{WORLD} | aio.py x1 (MB/s) "
          "| per rank / aio.py x1 | ranks summed (MB/s) | summed / aio.py x1 |\n|---|---|---|---|---|---|---|---|")
    for name, op, kind in (("read", "read", "read"), ("write", "write_fresh", "write"),
                           ("grad read (backward)", "read", "grad_read"),
                           ("grad write (backward)", "write_fresh", "grad_write")):
        rates = [r[f"{kind}_bytes"] / r[f"{kind}_s"] for r in seq if r.get(f"{kind}_s")]
        if not rates:
            continue
        got, each, solo, both = sum(rates), sum(rates) / len(rates), baseline[op], baseline[f"{op}_concurrent"]
        print(f"| {name} | {each / 1e6:.0f} | {both / 1e6:.0f} | {each / both:.2f} | {solo / 1e6:.0f} | "
              f"{each / solo:.2f} | {got / 1e6:.0f} | {got / solo:.2f} |")


def _ratio(num: float, den: float | None) -> str:
    return f"{num / den:.2f}" if den else "-"


if __name__ == "__main__":
    main()
