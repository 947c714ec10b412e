"""Our ZeRO checkpoints through the real DeepSpeed's universal-checkpoint converter, loaded back on both sides.

For each case (ZeRO stage and precision, 2 gloo ranks; the model, data and optimizer of
``scripts/cross-checkpoints.py``, whose worker this script runs): this project trains N steps, saves and trains M
more (its own continuation); the real DeepSpeed's ``python -m deepspeed.checkpoint.ds_to_universal`` converts the
saved tag into a universal checkpoint; then the real DeepSpeed and this project each build the model from *another*
seed, load the universal checkpoint (``checkpoint.load_universal: true``) and train the same M steps. Both
continuations are compared with ours, loss by loss, on every rank. With ``--control`` the real DeepSpeed also
saves the case itself and the same conversion and loads follow (what DeepSpeed's own files give, for reference).

Usage (the project's python): ``bash scripts/hatch run test:python scripts/cross-universal.py [--cases a,b]
[--steps N M] [--control] [--keep DIR]``. Needs the side venv of ``scripts/real-deepspeed-venv.sh``; minutes per
case. Prints one line per case and a table; exits 1 unless every loss agrees.

The converter is given ``--inject_missing_state``: a plain model's checkpoint (DeepSpeed's as ours) carries no
``universal_checkpoint_info``, which only Megatron-style clients or AutoTP write.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("cross_checkpoints", os.path.join(HERE, "cross-checkpoints.py"))
cc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cc)

CASES = ["stage1-fp32", "stage1-bf16", "stage2-fp32", "stage2-bf16", "stage3-fp32", "stage3-bf16"]
TOL = 0.0  # "same losses" means equal to every digit; the table shows the largest difference otherwise


def _convert(real: str, folder: str, timeout: float) -> str:
    """Run the real converter on ``ckpt/cross`` into ``ckpt/universal``; returns "" or the failure's last line."""
    ckpt = os.path.join(folder, "ckpt")
    cmd = [real, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", os.path.join(ckpt, "cross"),
           "--output_folder", os.path.join(ckpt, "universal"), "--inject_missing_state",
           "--num_extract_workers", "1", "--num_merge_workers", "1"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=folder)
    except subprocess.TimeoutExpired:
        return f"ds_to_universal timed out after {timeout:.0f} s"
    with open(os.path.join(folder, "convert.log"), "w") as log:
        log.write(done.stdout + done.stderr)
    if done.returncode == 0:
        return ""
    lines = [line for line in (done.stdout + done.stderr).strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return "ds_to_universal: " + ((errors or lines or [f"exit code {done.returncode}"])[-1].strip())[:200]


def _compare(ref: list, got: list | None, n: int, why: str) -> dict:
    if got is None:
        return {"ok": False, "why": why}
    diff = max(abs(a - b) for r in range(2) for a, b in zip(ref[r][n:], got[r], strict=True))
    return {"ok": diff <= TOL, "diff": diff, "losses": got[0],
            "why": "" if diff <= TOL else f"losses differ (max {diff:.3g})"}


def _run_case(case: str, saver: str, ours: str, real: str, args: argparse.Namespace, label: str) -> dict:
    folder = tempfile.mkdtemp(prefix=f"cross-uc-{case}-")
    n, m, timeout = args.n, args.m, args.timeout
    try:
        ref, error = cc._launch(saver, case, "save", folder, n, m, timeout)
        if ref is None:
            return {"ref": None, "why": f"save failed: {error}"}
        error = _convert(real, folder, timeout)
        if error:
            return {"ref": ref[0][n:], "why": error}
        out = {"ref": ref[0][n:], "why": ""}
        load = ("--tag", "universal", "--universal")
        for side, python in (("real", real), ("ours", ours)):
            got, error = cc._launch(python, case, f"load-{side}", folder, n, m, timeout, load)
            out[side] = _compare(ref, got, n, f"load failed: {error}")
        return out
    finally:
        if args.keep:
            shutil.copytree(folder, os.path.join(args.keep, f"{case}-{label}"), dirs_exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)


def _cell(result: dict | None) -> str:
    if result is None:
        return "-"
    return "same losses" if result["ok"] else result["why"].replace("|", "/")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    parser.add_argument("--steps", nargs=2, type=int, default=[4, 4], metavar=("N", "M"))
    parser.add_argument("--control", action="store_true", help="also convert and load the real DeepSpeed's save")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per 2-rank launch or conversion")
    parser.add_argument("--keep", help="copy each case's checkpoints and logs under this folder")
    args = parser.parse_args()
    args.n, args.m = args.steps
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in cc.CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; accepted: {', '.join(cc.CASES)}")
    ours, real = sys.executable, cc._real_python()
    cc._prebuild(real)
    print(f"ours: deepspeed {cc._version(ours)}; real: deepspeed {cc._version(real)}; 2 gloo ranks, "
          f"N={args.n} steps, save, M={args.m} steps", flush=True)
    rows = []
    savers = [("ours", ours)] + ([("real", real)] if args.control else [])
    for case in cases:
        for label, saver in savers:
            r = _run_case(case, saver, ours, real, args, f"{label}-saved")
            rows.append((case, label, r))
            detail = "; ".join(f"{side} {r[side]['losses']}" for side in ("real", "ours") if r.get(side, {}).get(
                "losses"))
            print(f"{case} saved by {label}: converted {'yes' if not r['why'] else 'NO: ' + r['why']}; "
                  f"real DS loads: {_cell(r.get('real'))}; ours loads: {_cell(r.get('ours'))}; "
                  f"saver's own continuation {r['ref']}; {detail}", flush=True)
    print("\n| case | saved by | ds_to_universal (real) | load_universal, real DS | load_universal, ours |"
          "\n|---|---|---|---|---|")
    for case, label, r in rows:
        converted = "converts" if not r["why"] else r["why"].replace("|", "/")
        print(f"| {case} | {label} | {converted} | {_cell(r.get('real'))} | {_cell(r.get('ours'))} |")
    ok = all(not r["why"] and r["real"]["ok"] and r["ours"]["ok"] for _, _, r in rows)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
