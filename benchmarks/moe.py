"""The Mixture-of-Experts layer (``ds_moe.layer.MoE``): forward + backward throughput against a dense MLP with the
same active parameters per token, at expert-parallel sizes 1 and 2, and the indexed dispatch against DeepSpeed's
dense one-hot einsum dispatch.

Layer: ``MoE(--hidden, expert, num_experts, ep_size, k)`` with every other argument at DeepSpeed's default
(``capacity_factor`` 1.0 unless ``--capacity_factor``, ``min_capacity`` 4, ``drop_tokens=True``, Random Token
Selection for top-1, Gumbel-sampled second expert for top-2), in training mode. ``expert`` = ``Linear(--hidden,
--ffn)``, ``GELU``, ``Linear(--ffn, --hidden)``. One iteration = forward of ``S`` tokens ``[S, hidden]`` (input
requiring grad, as the activations of a layer below would) and backward of the output against a fixed random
gradient plus ``l_aux`` (weight 1); gradients set to None before each. No optimizer step and no gradient
reduction (neither the dense baseline's data-parallel all-reduce nor the gate's): the layer alone.
Built after ``torch.manual_seed(0)`` on every rank (same gate and experts everywhere); each rank draws its own
tokens. fp32, gloo, every rank runs 1 torch thread (the harness's default); ranks from the shared test harness
(``tests/_harness.run_distributed``): one launch of 1 rank (ep_size 1 and table 2), one of 2 ranks (ep_size 2).

1. Throughput against dense. ``--tokens`` tokens per rank, ``--experts`` experts, for each k in ``--ks``.
   Baseline: ``Linear(hidden, k * ffn)``, ``GELU``, ``Linear(k * ffn, hidden)`` on the same tokens: the same
   weights per token as the k experts a token goes to (up to k - 1 output biases; the gate's ``hidden x
   experts`` router weights come on top for the MoE), and the same expert FLOPs: the MoE runs its experts on
   ``experts x capacity`` = ``k x tokens`` buffer rows (``capacity`` = ceil(tokens / experts * capacity_factor
   * k)) whether or not tokens were dropped, so at capacity factor 1 the difference to dense is the gate, the
   dispatch and combine, and at ep_size 2 the all-to-alls (two in forward, two in backward). With 2 ranks,
   each rank runs the MoE (ep_size 2: ``experts / 2`` local experts, buffers exchanged over gloo), the same
   layer at ep_size 1 (every expert replicated on every rank: no all-to-all; what ep_size 2 costs in
   communication) and the dense MLP on its own tokens. Each repetition times one iteration of each variant in
   rotating order, after a barrier; an iteration's time is the slowest rank's; tokens/s is the aggregate
   (ranks x tokens / time). Reported: median ms and tokens/s, and tokens/s of the MoE / dense as the ratio of
   medians and the median of per-repetition ratios (paired); ``CPU paired`` is the paired ratio from process CPU
   time (all threads, slowest rank), which other jobs' load inflates far less. ``kept`` = token choices that
   got a slot / (k x tokens) on rank 0 (the rest are dropped: zero output from the MoE).
2. Dispatch. One rank, ep_size 1, for each ``tokens x experts`` of ``--cases`` and each k: the same layer
   (same weights, same tokens) with ``deepspeed_moe.dispatch_mode`` = ``"indexed"`` (slot indices:
   ``index_copy`` into the ``[E, C, M]`` buffers, gather + weight to combine) and ``"einsum"`` (DeepSpeed's
   dense one-hot ``[S, E, C]`` ``combine_weights`` / ``dispatch_mask`` and the ``sec,sm->ecm`` /
   ``sec,ecm->sm`` einsums), and, as the floor both sit on, the experts alone (forward + backward of
   ``Experts`` on a ``[1, E, C, M]`` buffer). The first iteration of each mode is untimed and compared: run from
   the same RNG state (the gate's noise), ``max |diff|`` is the largest difference between the two modes'
   outputs, input gradients and parameter gradients. Memory, by accounting: that iteration runs under
   ``torch.profiler`` with ``profile_memory=True``; the peak of the running sum of the CPU allocator's
   allocation and free events (bytes torch allocated during the iteration beyond what was held before it,
   output and gradients included) is reported per mode. Then ``--dispatch_reps`` repetitions, each timing one
   iteration of each in rotating order. Reported: median ms, einsum / indexed (ratio of medians, paired median;
   CPU paired as above) and each mode's overhead over the experts alone (layer - experts: gate + dispatch +
   combine). ``[S,E,C] MiB`` = one dense fp32 ``[S, E, C]`` tensor, which the einsum path builds several of
   (per-choice terms, their sum, the mask, gradients).

Run: ``python benchmarks/moe.py`` (``--quick`` for a short run, ``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

TESTS_DIR = str(Path(__file__).resolve().parents[1] / "tests")
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import paired  # noqa: E402 - benchmarks/ is on the path when this script runs
from _harness import run_distributed, shutdown_pool  # noqa: E402
from torch import nn  # noqa: E402

MB = 1 << 20


def _cases(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        if item.strip():
            s, e = item.lower().split("x")
            out.append((int(s), int(e)))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256, help="model width (tokens are [S, hidden])")
    parser.add_argument("--ffn", type=int, default=1024, help="expert's inner width: Linear(hidden, ffn), GELU, "
                        "Linear(ffn, hidden); the dense baseline's is k x ffn")
    parser.add_argument("--tokens", type=int, default=4096, help="table 1: tokens per rank")
    parser.add_argument("--experts", type=int, default=8, help="table 1: experts (a multiple of 2)")
    parser.add_argument("--ks", default="1,2", help="top-k values (1 and/or 2)")
    parser.add_argument("--capacity_factor", type=float, default=1.0, help="MoE capacity_factor")
    parser.add_argument("--worlds", default="1,2", help="table 1: rank counts; ep_size = ranks")
    parser.add_argument("--reps", type=int, default=7, help="table 1: timed repetitions")
    parser.add_argument("--warmup", type=int, default=1, help="table 1: untimed iterations per variant first")
    parser.add_argument("--cases", default="4096x8,8192x32", help="table 2: comma-separated TOKENSxEXPERTS")
    parser.add_argument("--dispatch_reps", type=int, default=3, help="table 2: timed repetitions")
    parser.add_argument("--quick", action="store_true", help="table 1: 2048 tokens, 3 reps; table 2: 4096x8 "
                        "only, 2 reps")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.reps, args.cases, args.dispatch_reps = 2048, 3, "4096x8", 2
    args.ks = [int(k) for k in args.ks.split(",") if k.strip()]
    args.worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    args.cases = _cases(args.cases)
    if not args.ks or any(k not in (1, 2) for k in args.ks):
        parser.error("--ks: the MoE layer supports k = 1 and 2")
    if any(w not in (1, 2) for w in args.worlds):
        parser.error("--worlds: 1 and/or 2 ranks")
    if args.experts % max(args.worlds, default=1):
        parser.error(f"--experts ({args.experts}) must be a multiple of every world size")
    for name in ("hidden", "ffn", "tokens", "experts", "reps", "dispatch_reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.warmup < 0 or args.capacity_factor <= 0:
        parser.error("--warmup must be >= 0 and --capacity_factor > 0")
    return args


# ---- models and one iteration -----------------------------------------------------------------------------------
def ffn(hidden: int, inner: int) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden))


def moe_layer(args: argparse.Namespace, experts: int, ep_size: int, k: int):
    from ds_moe.layer import MoE

    torch.manual_seed(0)
    layer = MoE(args.hidden, ffn(args.hidden, args.ffn), num_experts=experts, ep_size=ep_size, k=k,
                capacity_factor=args.capacity_factor)
    layer.set_deepspeed_parallelism()
    return layer


def dense_mlp(args: argparse.Namespace, k: int) -> nn.Module:
    torch.manual_seed(0)
    return ffn(args.hidden, k * args.ffn)


def capacity(tokens: int, experts: int, capacity_factor: float, k: int, min_capacity: int = 4) -> int:
    """The MoE's slots per expert (training, drop_tokens=True)."""
    return max(math.ceil(tokens / experts * capacity_factor * k), min_capacity)


def tokens_for(rank: int, tokens: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(tokens, hidden, generator=g).requires_grad_(True), torch.randn(tokens, hidden, generator=g)


def moe_iteration(layer, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out, l_aux, counts = layer(x)
    torch.autograd.backward([out, l_aux], [grad, torch.ones_like(l_aux)])
    return out, counts


def dense_iteration(mlp: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    mlp.zero_grad(set_to_none=True)
    x.grad = None
    mlp(x).backward(grad)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) ``fn()`` took, each the slowest rank's (started after a barrier)."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    t = torch.tensor([time.perf_counter() - start, time.process_time() - cpu], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


def interleaved(variants: dict, reps: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    """{"wall"|"cpu": {variant: seconds per repetition}}: ``reps`` rounds of every variant, rotating the order."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    names = list(variants)
    times: dict[str, dict[str, list[float]]] = {"wall": {n: [] for n in names}, "cpu": {n: [] for n in names}}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            wall, cpu = timed(variants[name])
            times["wall"][name].append(wall)
            times["cpu"][name].append(cpu)
    return times


# ---- memory accounting ----------------------------------------------------------------------------------------
@contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null: kineto logs every profiler start/stop/stage there, whatever the level."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_allocated(fn) -> int:
    """Peak bytes torch's CPU allocator held during ``fn()`` beyond what it held before (profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


# ---- the rank bodies ----------------------------------------------------------------------------------------
def throughput_rank(args: argparse.Namespace) -> dict:
    """Table 1 on this launch's ranks: the MoE at ep_size = world (and at ep_size 1 when world > 1) vs dense."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x, grad = tokens_for(rank, args.tokens, args.hidden)
    out: dict = {"rank": rank, "times": {}, "kept": {}, "params": {}}
    for k in args.ks:
        layers = {"moe": moe_layer(args, args.experts, world, k)}
        if world > 1:
            layers["moe_ep1"] = moe_layer(args, args.experts, 1, k)
        mlp = dense_mlp(args, k)
        variants = {name: functools.partial(moe_iteration, layer, x, grad) for name, layer in layers.items()}
        variants["dense"] = functools.partial(dense_iteration, mlp, x, grad)
        out["times"][k] = interleaved(variants, args.reps, args.warmup)
        _, counts = moe_iteration(layers["moe"], x, grad)
        cap = capacity(args.tokens, args.experts, args.capacity_factor, k)
        out["kept"][k] = float(counts.clamp(max=cap).sum()) / (k * args.tokens)
        expert_params = sum(p.numel() for p in ffn(args.hidden, args.ffn).parameters())
        out["params"][k] = {"active_moe": k * expert_params + args.hidden * args.experts,
                            "dense": sum(p.numel() for p in mlp.parameters()), "capacity": cap}
    return out


def _checked_iteration(layer, x: torch.Tensor, grad: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """One iteration from a fixed RNG state: (peak bytes allocated, [output, input grad, parameter grads])."""
    torch.manual_seed(1)  # the same gate noise (RTS draw / Gumbel second expert) for both modes
    layer.zero_grad(set_to_none=True)  # free the last iteration's gradients outside the measured window
    x.grad = None
    result: list = []
    peak = peak_allocated(lambda: result.append(moe_iteration(layer, x, grad)[0]))
    return peak, [result[0].detach(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]


def _with_mode(layer, mode: str, x: torch.Tensor, grad: torch.Tensor) -> None:
    layer.deepspeed_moe.dispatch_mode = mode
    moe_iteration(layer, x, grad)


def _experts_only(experts: nn.Module, buf: torch.Tensor, buf_grad: torch.Tensor) -> None:
    experts.zero_grad(set_to_none=True)
    buf.grad = None
    experts(buf).backward(buf_grad)


def dispatch_case(args: argparse.Namespace, tokens: int, experts: int, k: int) -> dict:
    """Table 2, one row: indexed vs einsum dispatch, same layer and tokens, plus the experts alone."""
    x, grad = tokens_for(0, tokens, args.hidden)
    layer = moe_layer(args, experts, 1, k)
    cap = capacity(tokens, experts, args.capacity_factor, k)
    peak, checked = {}, {}
    for mode in ("indexed", "einsum"):
        layer.deepspeed_moe.dispatch_mode = mode
        peak[mode], checked[mode] = _checked_iteration(layer, x, grad)
    diff = max(float((a - b).abs().max()) for a, b in zip(checked["indexed"], checked["einsum"], strict=True))
    del checked
    buf = torch.randn(1, experts, cap, args.hidden, generator=torch.Generator().manual_seed(5), requires_grad=True)
    buf_grad = torch.randn_like(buf)
    variants = {mode: functools.partial(_with_mode, layer, mode, x, grad) for mode in ("indexed", "einsum")}
    variants["experts"] = functools.partial(_experts_only, layer.deepspeed_moe.experts, buf, buf_grad)
    variants["experts"]()  # its warm-up (the modes' checked iterations were theirs)
    times = interleaved(variants, args.dispatch_reps, 0)
    return {"tokens": tokens, "experts": experts, "k": k, "capacity": cap, "times": times, "peak": peak,
            "diff": diff}


def dispatch_rank(args: argparse.Namespace) -> list[dict]:
    return [dispatch_case(args, tokens, experts, k) for tokens, experts in args.cases for k in args.ks]


def single_rank(args: argparse.Namespace) -> dict:
    out = throughput_rank(args) if 1 in args.worlds else {}
    out["dispatch"] = dispatch_rank(args) if args.cases else []
    return out


def run(args: argparse.Namespace) -> dict:
    results = {}
    for world in sorted(set(args.worlds) | {1}):
        started, load = time.perf_counter(), _load()
        body = single_rank if world == 1 else throughput_rank
        ranks = run_distributed(body, world_size=world, args=(args,), timeout=1800)
        results[world] = (ranks, time.perf_counter() - started, (load, _load()))
    shutdown_pool()
    return results


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


# ---- report -------------------------------------------------------------------------------------------------------
def _ratio(num: list[float], den: list[float]) -> str:
    """num / den as the ratio of medians (the median of per-repetition ratios)."""
    return f"{statistics.median(num) / statistics.median(den):.3f}x ({paired(num, den):.3f}x)"


def report(args: argparse.Namespace, results: dict) -> str:
    lines = [f"MoE layer | {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} | "
             f"cores {os.cpu_count()} | load avg {_load():.1f} | torch {torch.__version__} | "
             f"Python {platform.python_version()} | gloo, 1 torch thread per rank",
             f"expert: Linear({args.hidden}, {args.ffn}) + GELU + Linear({args.ffn}, {args.hidden}); fp32; "
             f"capacity_factor {args.capacity_factor}; forward + backward (input grad, l_aux), no optimizer step"]
    for world, (_, wall, loads) in results.items():
        lines.append(f"{world} rank(s): took {wall:.0f} s, load avg {loads[0]:.1f} -> {loads[1]:.1f}")
    if any(w in results and "times" in results[w][0][0] for w in args.worlds):
        lines += ["", f"1. MoE forward + backward vs dense MLP with the same active parameters per token: "
                  f"{args.tokens} tokens per rank, {args.experts} experts; slowest rank, median of {args.reps} "
                  "interleaved reps; tokens/s aggregate over ranks; CPU = process CPU time (all threads)",
                  f"{'ranks':>5} | {'k':>1} | {'variant':<44} | {'ms/iter':>8} | {'tokens/s':>9} | "
                  f"{'MoE/dense tokens/s (paired)':>27} | {'CPU paired':>10} | {'kept':>5}"]
        for world in args.worlds:
            r0 = results[world][0][0]
            for k in args.ks:
                wall, cpu = r0["times"][k]["wall"], r0["times"][k]["cpu"]
                prm = r0["params"][k]
                total = world * args.tokens
                rows = [(f"MoE, ep_size {world} ({args.experts // world} local experts, C={prm['capacity']})", "moe")]
                if world > 1:
                    rows.append((f"MoE, ep_size 1 (all {args.experts} experts on each rank)", "moe_ep1"))
                rows.append((f"dense MLP {args.hidden}-{k * args.ffn}-{args.hidden} (data parallel)", "dense"))
                for label, key in rows:
                    med = statistics.median(wall[key])
                    moe = key != "dense"
                    cell = _ratio(wall["dense"], wall[key]) if moe else "1"
                    cpu_cell = f"{paired(cpu['dense'], cpu[key]):.3f}x" if moe else "1"
                    kept = f"{r0['kept'][k]:.3f}" if moe else ""
                    lines.append(f"{world:>5} | {k:>1} | {label:<44} | {med * 1e3:8.1f} | {total / med:9.0f} | "
                                 f"{cell:>27} | {cpu_cell:>10} | {kept:>5}")
                lines.append(f"{'':>5} | {'':>1}   active parameters per token: MoE {prm['active_moe'] / 1e6:.3f} M "
                             f"(k experts + router), dense {prm['dense'] / 1e6:.3f} M")
    dispatch = results[1][0][0]["dispatch"]
    if dispatch:
        lines += ["", f"2. indexed vs einsum dispatch, 1 rank, ep_size 1, same layer and tokens; forward + backward "
                  f"ms, median of {args.dispatch_reps} interleaved reps; experts = Experts alone on the [E, C, M] "
                  "buffer; overhead = layer - experts; peak alloc = accounting (profiler memory events)",
                  f"{'tokens x E':>11} | {'k':>1} | {'C':>5} | {'[S,E,C] MiB':>11} | {'einsum':>8} | "
                  f"{'indexed':>8} | {'experts':>8} | {'einsum/indexed (paired)':>23} | {'CPU paired':>10} | "
                  f"{'overhead einsum / indexed':>25} | {'peak alloc MiB e / i':>20} | {'max |diff|':>10}"]
        for row in dispatch:
            wall, cpu = row["times"]["wall"], row["times"]["cpu"]
            med = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
            dense_mib = row["tokens"] * row["experts"] * row["capacity"] * 4 / MB
            overhead = f"{med['einsum'] - med['experts']:.1f} / {med['indexed'] - med['experts']:.1f}"
            peak = f"{row['peak']['einsum'] / MB:.0f} / {row['peak']['indexed'] / MB:.0f}"
            lines.append(f"{row['tokens']:>6} x {row['experts']:>2} | {row['k']:>1} | {row['capacity']:>5} | "
                         f"{dense_mib:11.0f} | {med['einsum']:8.1f} | {med['indexed']:8.1f} | {med['experts']:8.1f} | "
                         f"{_ratio(wall['einsum'], wall['indexed']):>23} | "
                         f"{paired(cpu['einsum'], cpu['indexed']):9.3f}x | {overhead:>25} | {peak:>20} | "
                         f"{row['diff']:10.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(report(args, run(args)))


if __name__ == "__main__":
    main()
