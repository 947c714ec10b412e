"""Clean exits: short 2-rank jobs under ``torch.distributed.run`` (torchrun) must exit 0 every time.

Runs ``--jobs`` jobs of ``tests/deepspeed/_exit_job.py``, kinds in turn (ZeRO-2, ZeRO-3, ZeRO-3 on NVMe, a
2-stage pipeline, a 2-expert MoE), with the exit hook of ``deepspeed.comm._exit``; interleaved with each, the
same job with the previous exit behaviour (``--destroy-only``: destroy the registered groups only) as the
baseline, so both see the same machine load. Then ``--inflight`` jobs of each that leave collectives running at
exit (the race at its sharpest). A job is clean when torchrun exits 0, both ranks printed ``DONE`` and no rank
printed "terminate called". The CI test (``tests/deepspeed/test_clean_exit.py``) runs 5 jobs, one per kind.

    python benchmarks/clean_exit.py                  # 30 + 30 jobs, 10 + 10 in-flight jobs
    python benchmarks/clean_exit.py --jobs 10 --inflight 4
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_model, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "deepspeed" / "_exit_job.py"
KINDS = ("zero2", "zero3", "nvme", "pipe", "moe")


def run_job(kind: str, baseline: bool) -> tuple[bool, str, float]:
    """(clean, what happened, seconds) for one torchrun job of ``kind``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(JOB), kind, *(["--destroy-only"] if baseline else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return False, "timeout", time.perf_counter() - start
    out = done.stdout + done.stderr
    seconds = time.perf_counter() - start
    finished = out.count("DONE ") >= 2
    aborted = "terminate called" in out
    clean = done.returncode == 0 and finished and not aborted
    what = "ok" if clean else f"rc={done.returncode}{' abort' if aborted else ''}{'' if finished else ' unfinished'}"
    return clean, what, seconds


def _row(name: str, fixed: list[bool], base: list[bool]) -> str:
    return f"| {name:<9} | {len(fixed):>4} | {sum(fixed):>12} | {len(base):>4} | {sum(base):>15} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=30, help="jobs with the exit hook (kinds in turn), and as "
                                                            "many baseline jobs interleaved")
    parser.add_argument("--inflight", type=int, default=10, help="in-flight jobs of each (0: none)")
    args = parser.parse_args()
    results: dict[str, tuple[list[bool], list[bool]]] = {}
    plan = [KINDS[i % len(KINDS)] for i in range(args.jobs)] + ["inflight"] * args.inflight
    for i, kind in enumerate(plan):
        fixed, base = results.setdefault(kind, ([], []))
        for baseline, into in ((False, fixed), (True, base)):
            clean, what, seconds = run_job(kind, baseline)
            into.append(clean)
            print(f"[{i + 1}/{len(plan)}] {kind:<8} {'baseline' if baseline else 'fixed':<8} {what:<16} "
                  f"{seconds:6.1f} s", flush=True)
    print(f"\n{datetime.date.today()}  {cpu_model()}, {os.cpu_count()} cores, python {platform.python_version()}")
    print("| kind      | jobs | exit 0 (hook) | jobs | exit 0 (baseline) |")
    print("|-----------|------|---------------|------|-------------------|")
    for kind, (fixed, base) in results.items():
        print(_row(kind, fixed, base))
    regular = [results[k] for k in KINDS if k in results]
    fixed_all = [c for f, _ in regular for c in f]
    base_all = [c for _, b in regular for c in b]
    print(_row("all five", fixed_all, base_all))
    if fixed_all and not all(fixed_all):
        sys.exit(f"{len(fixed_all) - sum(fixed_all)} of {len(fixed_all)} jobs with the exit hook did not exit 0")


if __name__ == "__main__":
    main()
