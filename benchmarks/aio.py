"""ds_ops.aio throughput side by side with fio (libaio engine, direct I/O), as issue 5 asks.

Sequential write of a fresh file, overwrite of an existing one, and read, at each block size, queue depth
and thread count, for: fio; AsyncIOHandle with locked (page-aligned) buffers; with plain torch buffers; and
the thread-pool fallback with locked buffers. Every configuration runs once per repetition, interleaved
(fio, ours, ours, ..., then the next configuration) so that the noise of a virtual disk hits them alike;
medians are reported with ratios measured in the same run. Writes include an fsync at the end for every
row (fio: end_fsync=1), and reads start with the file evicted from the page cache.

Plain torch CPU tensors start 64 bytes into a page, so O_DIRECT reaches them through the handle's aligned
staging blocks (one memcpy per piece); the memcpy rate of such a buffer is measured and printed as the
bound of that path. Run with THP_MEM_ALLOC_ENABLE=1 and torch aligns allocations of 2 MiB or more to
2 MiB: plain buffers then take the copy-free direct path (the "modes used" line shows which ran).

    python benchmarks/aio.py                          # full: 512 MiB, 5 reps, bs 128K/1M, qd 8/32, threads 1/2
    python benchmarks/aio.py --size-mib 64 --reps 2 --block-sizes 1M --queue-depths 8 --threads 1   # quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import torch

from ds_ops.aio import AsyncIOHandle, _libaio, libaio_unavailable_reason

OPS = ("write_fresh", "overwrite", "read")
VARIANTS = ("fio", "locked", "plain", "fallback")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def ensure_fio() -> str | None:
    """fio's path, installing Debian's package when missing (root only)."""
    path = shutil.which("fio")
    if path or os.geteuid() != 0 or not shutil.which("apt-get"):
        return path
    print("fio missing: apt-get install -y fio", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "fio"], env=env, capture_output=True)
    return shutil.which("fio")


def fio_run(fio: str, path: str, op: str, size: int, bs: int, qd: int, threads: int) -> float:
    """Bytes/s fio reports for one job group (numjobs=threads, each on its own slice of the file)."""
    if op == "write_fresh" and os.path.exists(path):
        os.unlink(path)
    per = size // threads
    cmd = [
        fio, "--name=bench", f"--filename={path}", f"--rw={'read' if op == 'read' else 'write'}",
        f"--bs={bs}", f"--size={per}", f"--offset_increment={per}", f"--numjobs={threads}",
        f"--iodepth={qd}", "--ioengine=libaio", "--direct=1", "--group_reporting", "--output-format=json",
        "--thread",
    ]
    if op != "read":
        cmd.append("--end_fsync=1")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"fio failed: {' '.join(cmd)}\n{res.stderr}")
    job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]
    return float(job["read" if op == "read" else "write"]["bw_bytes"])


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def ours_run(handle: AsyncIOHandle, buf: torch.Tensor, path: str, op: str) -> tuple[float, str]:
    """Bytes/s of one request through ``handle`` (fsync included for writes) and the mode it used."""
    if op == "write_fresh" and os.path.exists(path):
        os.unlink(path)
    if op == "read":
        drop_cache(path)
    start = time.perf_counter()
    if op == "read":
        handle.sync_pread(buf, path)
    else:
        handle.sync_pwrite(buf, path, 0, whole_file=op == "write_fresh", fsync=True)
    return buf.numel() / (time.perf_counter() - start), handle.get_last_io_mode()


def memcpy_rate(buf: torch.Tensor, piece: int = 1 << 20) -> float:
    """Bytes/s of copying ``buf`` piece by piece into a reused aligned block, as the staging path does."""
    slot = torch.empty(piece, dtype=torch.uint8).fill_(0)
    start = time.perf_counter()
    for at in range(0, buf.numel() - piece + 1, piece):
        _libaio.memcpy(slot.data_ptr(), buf.data_ptr() + at, piece)
    return buf.numel() // piece * piece / (time.perf_counter() - start)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--block-sizes", default="128K,1M")
    p.add_argument("--queue-depths", default="8,32")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir in /tmp)")
    p.add_argument("--no-fio", action="store_true")
    return p.parse_args()


def _configs(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    return [
        (_size(b), int(q), int(t))
        for b in args.block_sizes.split(",")
        for q in args.queue_depths.split(",")
        for t in args.threads.split(",")
    ]


def main() -> None:
    args = _args()
    size = args.size_mib << 20
    fio = None if args.no_fio else ensure_fio()
    work = tempfile.mkdtemp(prefix="ds-aio-bench-", dir=args.dir)
    configs = _configs(args)
    source = torch.randint(0, 256, (size,), dtype=torch.uint8)
    probe = AsyncIOHandle(backend="threads")
    buffers = {"locked": probe.new_cpu_locked_tensor(size, torch.uint8), "plain": torch.empty(size, dtype=torch.uint8)}
    buffers["fallback"] = buffers["locked"]
    plain_offset = buffers["plain"].data_ptr() % 4096
    has_libaio = libaio_unavailable_reason() is None
    handles = {}
    for bs, qd, t in configs:
        for variant in ("locked", "plain", "fallback"):
            if variant != "fallback" and not has_libaio:
                continue
            backend = "threads" if variant == "fallback" else "libaio"
            handles[(variant, bs, qd, t)] = AsyncIOHandle(bs, qd, False, True, t, backend=backend)
    results: dict[tuple, list[float]] = defaultdict(list)
    modes: dict[tuple, str] = {}
    try:
        for rep in range(args.reps):
            for op in OPS:
                for bs, qd, t in configs:
                    if fio:
                        path = os.path.join(work, "fio.bin")
                        results[("fio", op, bs, qd, t)].append(fio_run(fio, path, op, size, bs, qd, t))
                    for variant in ("locked", "plain", "fallback"):
                        handle = handles.get((variant, bs, qd, t))
                        if handle is None:
                            continue
                        buf, path = buffers[variant], os.path.join(work, f"{variant}.bin")
                        if op != "read":
                            buf.copy_(source)
                        rate, mode = ours_run(handle, buf, path, op)
                        results[(variant, op, bs, qd, t)].append(rate)
                        modes[(variant, op)] = mode
                        if op == "read" and rep == 0 and not torch.equal(buf, source):
                            raise RuntimeError(f"{variant} read back different bytes")
            results[("memcpy",)].append(memcpy_rate(buffers["plain"]))
            print(f"repetition {rep + 1}/{args.reps} done", flush=True)
    finally:
        for h in handles.values():
            h.close()
        shutil.rmtree(work, ignore_errors=True)
    _report(args, fio, configs, results, modes, size, plain_offset)


def _report(args, fio, configs, results, modes, size, plain_offset) -> None:
    med = {k: statistics.median(v) / 1e9 for k, v in results.items()}
    print()
    print(f"date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, cores {os.cpu_count()}, "
          f"torch {torch.__version__}, python {platform.python_version()}, {platform.platform()}")
    fio_version = subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip() if fio else "-"
    print(f"fio {fio_version}; libaio: {libaio_unavailable_reason() or 'loaded'}; file {size >> 20} MiB; "
          f"median of {args.reps} interleaved repetitions; GB/s = 1e9 bytes/s")
    print(f"memcpy of the plain buffer in 1 MiB pieces (the staging bound): {med[('memcpy',)]:.2f} GB/s; "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}; "
          f"plain buffer address mod 4096 = {plain_offset}")
    print("modes used: " + ", ".join(f"{v}/{op}={m}" for (v, op), m in sorted(modes.items())))
    head = (f"{'op':<12}{'bs':>6}{'qd':>4}{'thr':>4} | {'fio':>6} | {'locked':>6} {'x fio':>6} | "
            f"{'plain':>6} {'x lock':>6} | {'fallbk':>6} {'x fio':>6}")
    print(head)
    print("-" * len(head))
    for op in OPS:
        for bs, qd, t in configs:
            row = {v: med.get((v, op, bs, qd, t)) for v in VARIANTS}
            print(f"{op:<12}{_fmt_bs(bs):>6}{qd:>4}{t:>4} | {_f(row['fio'])} | {_f(row['locked'])} "
                  f"{_r(row['locked'], row['fio'])} | {_f(row['plain'])} {_r(row['plain'], row['locked'])} | "
                  f"{_f(row['fallback'])} {_r(row['fallback'], row['fio'])}")
    print("\ncommand: " + " ".join([os.path.basename(sys.executable), *sys.argv]))


def _fmt_bs(bs: int) -> str:
    return f"{bs >> 20}M" if bs % (1 << 20) == 0 else f"{bs >> 10}K"


def _f(x: float | None) -> str:
    return f"{x:6.2f}" if x is not None else f"{'-':>6}"


def _r(a: float | None, b: float | None) -> str:
    return f"{a / b:6.2f}" if a is not None and b else f"{'-':>6}"


if __name__ == "__main__":
    main()
