"""``torch.save`` of a checkpoint-like state dict through ``deepspeed.io.FastFileWriter`` against the plain ways.

Baseline: ``torch.save`` through ``PyFileWriter`` (a Python file), then fsync. Compared: ``torch.save(obj, path)``
then fsync, and ``FastFileWriter`` with one and two pinned buffer slots (its ``close()`` fsyncs). Every variant writes
a fresh file once per repetition, interleaved in an order rotated every repetition, so disk noise and
position effects (write-back of the previous file) hit them alike; medians and ratios of medians from the
same run. Each writer's file is checked byte for byte against the baseline's (``torch.save(path)`` names the zip's
root folder after the file, so its bytes differ by that name).

    python benchmarks/fast_file_writer.py                    # 256 MiB, 5 reps, 16 MiB pinned buffer
    python benchmarks/fast_file_writer.py --size-mib 64 --reps 3
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time

import torch

from deepspeed.io import FastFileWriter, FastFileWriterConfig, PyFileWriter
from deepspeed.ops.op_builder import AsyncIOBuilder


def _state(size_mib: int) -> dict[str, torch.Tensor]:
    per = (size_mib << 20) // 8 // 4  # eight fp32 tensors
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(8)}


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--buffer-mib", type=int, default=16)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder under /tmp)")
    args = ap.parse_args()
    obj = _state(args.size_mib)
    handle = AsyncIOBuilder().load().aio_handle(block_size=1 << 20, queue_depth=8, single_submit=False,
                                                overlap_events=True, intra_op_parallelism=1)
    pinned = handle.new_cpu_locked_tensor(args.buffer_mib << 20, torch.uint8)

    def py_writer(path: str) -> None:
        w = PyFileWriter(path)
        torch.save(obj, w)
        w.close()
        _fsync(path)

    def torch_path(path: str) -> None:
        torch.save(obj, path)
        _fsync(path)

    def fast(double: bool):
        def run(path: str) -> None:
            with FastFileWriter(path, FastFileWriterConfig(handle, pinned, double_buffer=double)) as w:
                torch.save(obj, w)
        return run

    variants = {"PyFileWriter + fsync (baseline)": py_writer, "torch.save(path) + fsync": torch_path,
                "FastFileWriter, 1 slot": fast(False), "FastFileWriter, 2 slots": fast(True)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(dir=args.dir or "/tmp") as folder:
        reference = None
        for rep in range(args.reps):
            order = list(enumerate(variants.items()))
            for i, (name, fn) in order[rep % len(order):] + order[: rep % len(order)]:  # rotate: no fixed position
                path = os.path.join(folder, f"v{i}_{rep}.pt")
                start = time.perf_counter()
                fn(path)
                times[name].append(time.perf_counter() - start)
                with open(path, "rb") as f:
                    data = f.read()
                if fn is not torch_path:  # a path names the zip's root folder after the file: other bytes
                    reference = data if reference is None else reference
                    assert data == reference, f"{name}: bytes differ from the baseline's"
                os.unlink(path)
        nbytes = len(reference)
    base = statistics.median(times["PyFileWriter + fsync (baseline)"])
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {platform.python_version()}; {nbytes / 2**20:.0f} MiB file, {args.reps} reps, "
          f"pinned buffer {args.buffer_mib} MiB, aio backend {handle.get_backend()}")
    print("| variant | median s | GB/s | vs baseline (time ratio) |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} | {nbytes / med / 1e9:.2f} | {base / med:.2f}x |")
    handle.free_cpu_locked_tensor(pinned)


if __name__ == "__main__":
    main()
