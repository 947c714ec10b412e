"""One optimizer step of DeepSpeedCPUAdam vs torch.optim.AdamW (foreach, fused=True), with memory-bandwidth probes.

Cases: 1M, 16M, 64M params as one flat tensor and as 100 tensors; fp32, bf16, fp16 params; 1 and 2 threads.
The probes run in the same process: an in-place STREAM-like kernel ``a = a*s + b`` (12 bytes/element) and a
plain C AdamW loop (28 bytes/element), both compiled by the same op builder with -O3 and OpenMP.
Columns: ms/step (fastest of --reps steps after a warm-up; the variants of a case step round-robin so that
load from other processes hits them alike), ns/param, GB/s (bytes the update must move divided by the time:
28 B/param for fp32 params with fp32 states, 22 for 16-bit params with fp32 states, 14 for 16-bit params with
16-bit states as torch keeps them), "x fused" (time / AdamW(fused=True) time in the same case), "of probe"
(GB/s over the STREAM-like probe's GB/s at the same thread count).
Also: the fused update-and-copy step (fp32 master + bf16 copy) vs a plain step, JIT build time of the op
in an empty cache, and the cached load time in a fresh process.

Run: python benchmarks/cpu_adam.py [--sizes 1,16,64] [--threads 1,2] [--reps 7] [--with-default]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import subprocess
import sys
import tempfile
import time

import torch

from ds_ops import DeepSpeedCPUAdam
from ds_ops.op_builder import BandwidthProbeBuilder, best_simd_level, cpu_model

_BYTES = {"fp32": 28, "lowp+fp32 states": 22, "lowp states": 14}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def timed(step, reps: int) -> float:
    """Fastest of ``reps`` calls after one warm-up call (the machine is shared: the minimum is the
    least disturbed estimate)."""
    step()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def make_params(numel: int, tensors: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    per = numel // tensors
    params = []
    for _ in range(tensors):
        p = torch.nn.Parameter(torch.randn(per).to(dtype))
        p.grad = (torch.randn(per) * 1e-2).to(dtype)
        params.append(p)
    return params


def probe_steps(numel: int, threads: int) -> list[tuple[str, object, int]]:
    """(name, step, bytes/element) for the STREAM-like in-place kernel and the plain C AdamW loop."""
    lib = BandwidthProbeBuilder().load()
    lib.ds_probe_scale_add.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int64,
                                       ctypes.c_int]
    lib.ds_probe_plain_adamw.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    a, b = torch.randn(numel), torch.randn(numel)
    p, g, m, v = torch.randn(numel), torch.randn(numel) * 1e-2, torch.zeros(numel), torch.zeros(numel)
    hyper = torch.tensor([1e-3, 0.9, 0.999, 1e-8, 0.01, 10.0])
    keep = (a, b, p, g, m, v, hyper)  # the closures below hold raw pointers

    def stream() -> None:
        lib.ds_probe_scale_add(keep[0].data_ptr(), keep[1].data_ptr(), 0.999, numel, threads)

    def plain() -> None:
        lib.ds_probe_plain_adamw(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), numel, hyper.data_ptr(),
                                 threads)

    return [("probe a=a*s+b (in place)", stream, 12), ("probe plain C AdamW loop", plain, 28)]


def run_case(numel: int, tensors: int, dtype_name: str, threads: int, reps: int, with_default: bool) -> list[dict]:
    """All optimizers of one (size, layout, dtype, threads) case, stepped round-robin ``reps`` times so that
    load from other processes hits every variant alike; rows carry the fastest step and bytes per param."""
    torch.set_num_threads(threads)
    dtype = _DTYPES[dtype_name]
    kind = "lowp states" if dtype != torch.float32 else "fp32"
    variants = [("DeepSpeedCPUAdam", lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.01),
                 "lowp+fp32 states" if kind != "fp32" else "fp32")]
    if kind != "fp32":
        variants.append(("DeepSpeedCPUAdam 16-bit states",
                         lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.01, fp32_optimizer_states=False),
                         kind))
    variants += [("AdamW fused=True", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), kind),
                 ("AdamW foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), kind)]
    if with_default:
        variants.append(("AdamW default", lambda ps: torch.optim.AdamW(ps, lr=1e-3), kind))
    rows = [(name, make(make_params(numel, tensors, dtype)).step, _BYTES[key]) for name, make, key in variants]
    rows += probe_steps(numel, threads)
    times: list[list[float]] = [[] for _ in rows]
    for _, step, _ in rows:
        step()  # warm-up: allocates states, faults pages in
    for _ in range(reps):
        for i, (_, step, _) in enumerate(rows):
            start = time.perf_counter()
            step()
            times[i].append(time.perf_counter() - start)
    return [dict(name=name, seconds=min(t), bytes=nbytes) for (name, _, nbytes), t in zip(rows, times, strict=True)]


def fused_copy_ratio(numel: int, threads: int, reps: int) -> tuple[float, float]:
    """(plain step ms, update-and-copy step ms) for fp32 master params writing a bf16 copy, interleaved."""
    torch.set_num_threads(threads)
    opt = DeepSpeedCPUAdam(make_params(numel, 1, torch.float32), lr=1e-3)
    copies = [[torch.empty(numel, dtype=torch.bfloat16)]]
    plain = timed(opt.step, 1)
    fused = timed(lambda: opt.step(fp16_param_groups=copies), 1)
    for _ in range(reps):
        plain = min(plain, timed(opt.step, 1))
        fused = min(fused, timed(lambda: opt.step(fp16_param_groups=copies), 1))
    return plain * 1e3, fused * 1e3


def build_times() -> tuple[float, float]:
    """(JIT build seconds of cpu_adam into an empty cache, cached load seconds in a fresh process)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "DS_OPS_CACHE_DIR": cache}
        code = ("import time, torch\nfrom ds_ops.op_builder import CPUAdamBuilder\n"
                "t = time.perf_counter(); CPUAdamBuilder().load(); print(time.perf_counter() - t)")
        build = float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                     check=True).stdout.split()[-1])
        load = float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    check=True).stdout.split()[-1])
    return build, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,64", help="millions of params, comma separated")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--dtypes", default="fp32,bf16,fp16")
    parser.add_argument("--tensors", default="1,100", help="layouts: number of tensors holding the params")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--with-default", action="store_true", help="also time AdamW's default (single-tensor)")
    args = parser.parse_args()
    sizes = [int(float(s) * 1_000_000) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    print(f"cpu_adam benchmark  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {os.cpu_count()} cores, {cpu_model()}, simd {best_simd_level()}; torch {torch.__version__}")
    build, load = build_times()
    print(f"JIT build of cpu_adam (empty cache): {build:.1f} s (target < 30 s); cached load in a fresh "
          f"process: {load * 1e3:.1f} ms (target < 200 ms)")
    for t in threads:
        torch.set_num_threads(t)
        print(f"\nthreads={t}")
        print(f"{'params':>6} {'tensors':>7} {'dtype':>5}  {'optimizer':<32}{'ms/step':>9}{'ns/param':>9}"
              f"{'GB/s':>7}{'x fused':>8}{'of probe':>9}")
        for numel in sizes:
            for tensors in [int(x) for x in args.tensors.split(",")]:
                for dtype_name in args.dtypes.split(","):
                    rows = run_case(numel, tensors, dtype_name, t, args.reps, args.with_default)
                    fused = next(r["seconds"] for r in rows if r["name"] == "AdamW fused=True")
                    stream = 12 * numel / next(r["seconds"] for r in rows if r["name"].startswith("probe a=")) / 1e9
                    for r in rows:
                        gbs = r["bytes"] * numel / r["seconds"] / 1e9
                        print(f"{numel // 1_000_000:>5}M {tensors:>7} {dtype_name:>5}  {r['name']:<32}"
                              f"{r['seconds'] * 1e3:>9.2f}{r['seconds'] / numel * 1e9:>9.3f}{gbs:>7.1f}"
                              f"{r['seconds'] / fused:>8.3f}{gbs / stream:>9.2f}")
        plain_ms, fused_ms = fused_copy_ratio(max(sizes), t, args.reps)
        print(f"update-and-copy (fp32 -> bf16 copy) at {max(sizes) // 1_000_000}M: plain {plain_ms:.2f} ms, "
              f"with copy {fused_ms:.2f} ms = {fused_ms / plain_ms:.3f}x (target <= 1.15x)")


if __name__ == "__main__":
    main()
