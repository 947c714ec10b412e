"""This project against its peers, side by side in one run: real DeepSpeed, torch DDP and torch FSDP2.

Every row trains the same model (seed 0) on the same batches with the same optimizer math (AdamW, lr 1e-3,
betas 0.9/0.95, weight decay 0.01: each framework's own AdamW for its config, torch's fused kernel for the torch
peers) on ``--world`` gloo ranks with one torch thread per rank. Each measurement is a fresh launch of
``benchmarks/_peers_worker.py`` by the interpreter that holds the framework: this project's in the bench env,
the newest DeepSpeed release pip offers in its own venv (``scripts/real-deepspeed-venv.sh``, built once next to
the build tree; its ops JIT-built on first use as its docs say for a plain ``pip install``), DDP and FSDP2 in the
bench env. Repetitions interleave the frameworks (rotating order), so drifting load hits all of them; the table
gives medians with the [min-max] spread and the ratio ours/peer as the median of per-repetition ratios (< 1:
ours is faster / smaller). CPU ms/step is the busier rank's user + system CPU time per timed step (every thread
of the rank's process): on a shared machine it moves far less with other jobs' load than wall time does, so its
ratio is the steadier comparison of the work each framework does. A row a framework cannot run shows its error
instead.

Rows (``--rows``, comma-separated; ``--models mlp,gpt``): ``stage0`` (peers: real DeepSpeed, DDP), ``stage1``,
``stage2``, ``stage3`` (+ FSDP2), ``stage2+cpu``, ``stage3+cpu`` (CPU offload of the optimizer, and of the
parameters at stage 3), ``stage3+nvme``; ``ckpt2`` / ``ckpt3`` (checkpoint save/load time, bytes on disk and
``zero_to_fp32`` time at stage 2/3, MLP); ``pipe`` (``PipelineModule`` of 8 Linear(1024)+GELU layers in 2 stages,
one ``train_batch`` of 8 micro-batches of 4 per step, 2 ranks), ``moe`` (the ``MoE`` layer, 4 FFN experts of width
512, top-1, ``ep_size`` 2 on 2 ranks, 256 tokens per rank) and ``infer`` (greedy ``generate`` of 32 new tokens for 4
prompts of 32 on a tiny random GPT-2, 1 process, peer: plain Hugging Face ``generate``; its tokens/s table gives
this / ours, > 1: the peer is faster) run their own model whatever ``--models`` says. First-step latency
(interpreter launch to the end of the first step: import + initialize + first step) comes from every stage-0 job.
Models: ``mlp`` (6 x Linear(1024)+GELU, micro batch 16), ``gpt`` (4 layers, d 256, 4 heads, seq 256, vocab 4096,
micro batch 4).
Run: ``hatch run bench:peers`` (``--quick``: MLP, stage 0/2/3, 2 repetitions; ``--help``).
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "_peers_worker.py"

STAGE_ROWS = {"stage0": (0, None), "stage1": (1, None), "stage2": (2, None), "stage3": (3, None),
              "stage2+cpu": (2, "cpu"), "stage3+cpu": (3, "cpu"), "stage3+nvme": (3, "nvme")}
CKPT_ROWS = {"ckpt2": 2, "ckpt3": 3}
# rows with their own model, not run per --models: (gloo ranks, frameworks besides ours and real DeepSpeed)
OWN_MODEL_ROWS = {"pipe": (2, []), "moe": (2, []), "infer": (1, ["hf"])}
ROWS = (*STAGE_ROWS, *CKPT_ROWS, *OWN_MODEL_ROWS)
MODELS = ("mlp", "gpt")
TORCH_PEER = {"stage0": "ddp", "stage3": "fsdp2"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {ROWS}")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {MODELS}")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps after the first")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks")
    parser.add_argument("--no-real", action="store_true", help="leave real DeepSpeed out (no side venv)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one measurement may take")
    parser.add_argument("--quick", action="store_true", help="MLP, stage0/stage2/stage3, 2 reps x 10 steps")
    parser.add_argument("--json", default=None, help="also write every measurement to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.models, args.reps, args.steps, args.warmup = "stage0,stage2,stage3", "mlp", 2, 10, 3
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for name, chosen, known in (("rows", args.rows, ROWS), ("models", args.models, MODELS)):
        bad = [c for c in chosen if c not in known]
        if bad or not chosen:
            parser.error(f"--{name}: unknown or empty {bad or chosen}; accepted: {', '.join(known)}")
    for name in ("reps", "steps", "world"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def real_python() -> tuple[str | None, str]:
    """The side venv's python (built on first use), or None and why not."""
    try:
        out = subprocess.run(["bash", str(ROOT / "scripts" / "real-deepspeed-venv.sh")], capture_output=True,
                             text=True, timeout=3600, check=True)
        return out.stdout.strip().splitlines()[-1], ""
    except (subprocess.SubprocessError, OSError, IndexError) as exc:
        err = getattr(exc, "stderr", "") or str(exc)
        return None, f"real DeepSpeed venv unavailable: {err.strip().splitlines()[-1] if err.strip() else exc}"


def plan(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """(row label, framework label, job) for every measurement of one repetition."""
    out = []
    for row in [r for r in args.rows if r in OWN_MODEL_ROWS]:
        world, peers = OWN_MODEL_ROWS[row]
        for fw in ["ours", "real", *peers]:
            framework = "deepspeed" if fw in ("ours", "real") else fw
            out.append((row, fw, {"kind": row, "framework": framework, "world": world, "steps": args.steps,
                                  "warmup": args.warmup}))
    for model in args.models:
        for row in [r for r in args.rows if r not in OWN_MODEL_ROWS]:
            if row in CKPT_ROWS:
                if model != "mlp":
                    continue
                job = {"model": model, "stage": CKPT_ROWS[row], "ckpt": True}
                frameworks = ["ours", "real"]
            else:
                stage, offload = STAGE_ROWS[row]
                job = {"model": model, "stage": stage, "offload": offload}
                frameworks = ["ours", "real"] + ([TORCH_PEER[row]] if row in TORCH_PEER else [])
            for fw in frameworks:
                framework = "deepspeed" if fw in ("ours", "real") else fw
                out.append((f"{model}/{row}", fw, {**job, "framework": framework, "world": args.world,
                                                  "steps": args.steps, "warmup": args.warmup}))
    return out


def extensions_dir(python: str) -> str:
    """Real DeepSpeed's JIT-built ops (its CPU shared-memory comm op, CPU Adam, ...) in a folder of its venv, clear
    of other users' torch_extensions; a lock left there by a killed build (over 20 minutes old) is removed."""
    folder = Path(os.path.abspath(python)).parent.parent / "torch_extensions"  # the venv's, not its base's
    folder.mkdir(exist_ok=True)
    for lock in folder.glob("*/*/lock"):
        if time.time() - lock.stat().st_mtime > 1200:
            lock.unlink(missing_ok=True)
    return str(folder)


def run_one(python: str, job: dict, timeout: int, real: bool = False) -> dict:
    env = {**os.environ, "PEERS_LAUNCHED": repr(time.time()), "OMP_NUM_THREADS": "1"}
    if real:
        env["TORCH_EXTENSIONS_DIR"] = extensions_dir(python)
    try:
        proc = subprocess.run([python, str(WORKER), json.dumps(job)], capture_output=True, text=True, env=env,
                              timeout=timeout, cwd=str(HERE))
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PEERS_RESULT ")]
    if not lines:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        errs = [line for line in tail if "Error" in line or "error" in line]
        return {"error": ((errs or tail or ["exit code " + str(proc.returncode)])[-1]).strip()[:300]}
    return json.loads(lines[-1][len("PEERS_RESULT "):])


def fmt_spread(values: list[float], digits: int = 1) -> str:
    if not values:
        return "—"
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def paired_ratio(ours: list[float], peer: list[float]) -> str:
    pairs = [a / b for a, b in zip(ours, peer, strict=False) if b > 0]
    return f"{statistics.median(pairs):.2f}x" if pairs else "—"


def collect(results: dict, key: tuple[str, str], name: str) -> list[float]:
    """Per repetition: the median step time ('step'), or one scalar field of the result."""
    out = []
    for res in results.get(key, []):
        if "error" in res:
            continue
        out.append(statistics.median(res["step_ms"]) if name == "step" else res.get(name))
    return [v for v in out if v is not None]


def error_of(results: dict, key: tuple[str, str]) -> str | None:
    errs = [r["error"] for r in results.get(key, []) if "error" in r]
    return errs[0] if errs and len(errs) == len(results.get(key, [])) else None


def report(results: dict, labels: list[tuple[str, str]], args: argparse.Namespace, header: str) -> str:
    rows_seen = list(dict.fromkeys(row for row, _ in labels))
    lines = [header, "", "| row | framework | step ms median [min-max] | ours / this (paired) | CPU ms/step | "
             "CPU ours / this | peak RSS MiB/rank | first step s |", "|---|---|---|---|---|---|---|---|"]
    for row in rows_seen:
        ours_steps = collect(results, (row, "ours"), "step")
        ours_cpu = collect(results, (row, "ours"), "cpu_ms")
        for fw in [fw for r, fw in labels if r == row]:
            key = (row, fw)
            err = error_of(results, key)
            if err:
                lines.append(f"| {row} | {fw} | error: {err} | | | | | |")
                continue
            steps = collect(results, key, "step")
            ratio = "1" if fw == "ours" else paired_ratio(ours_steps, steps)
            rss = fmt_spread(collect(results, key, "peak_rss_mib"), 0)
            first = fmt_spread(collect(results, key, "first_step_s"), 1) if row.endswith("stage0") else ""
            cpu = collect(results, key, "cpu_ms")
            cpu_ratio = "1" if fw == "ours" else paired_ratio(ours_cpu, cpu)
            lines.append(f"| {row} | {fw} | {fmt_spread(steps)} | {ratio} | {fmt_spread(cpu)} | {cpu_ratio} | {rss} | "
                         f"{first} |")
    losses = [f"{row} {fw} {fmt_spread(collect(results, (row, fw), 'last_loss'), 5)}"
              for row, fw in labels if row in ("pipe", "moe") and not error_of(results, (row, fw))]
    if losses:
        lines += ["", "Loss after the last timed step (max over ranks): " + "; ".join(losses)]
    infer_rows = [r for r in rows_seen if r == "infer"]
    if infer_rows:
        lines += ["", "| row | framework | generate tokens/s median [min-max] | this / ours (paired) | "
                  "same tokens as hf |", "|---|---|---|---|---|"]
        hf_tokens = [r.get("generated") for r in results.get(("infer", "hf"), []) if "error" not in r]
        ours_tps = collect(results, ("infer", "ours"), "tokens_per_s")
        for fw in [fw for r, fw in labels if r == "infer"]:
            if error_of(results, ("infer", fw)):
                lines.append(f"| infer | {fw} | error: {error_of(results, ('infer', fw))} | | |")
                continue
            tps = collect(results, ("infer", fw), "tokens_per_s")
            mine = [r.get("generated") for r in results[("infer", fw)] if "error" not in r]
            same = "—" if not hf_tokens else "yes" if all(t == hf_tokens[0] for t in mine) else "**no**"
            lines.append(f"| infer | {fw} | {fmt_spread(tps, 0)} | "
                         f"{'1' if fw == 'ours' else paired_ratio(tps, ours_tps)} | {same} |")
    ckpt_rows = [r for r in rows_seen if r.rsplit("/", 1)[-1] in CKPT_ROWS]
    if ckpt_rows:
        lines += ["", "| row | framework | save s | load s | MiB on disk | zero_to_fp32 s | ours / this (save, load, "
                  "zero_to_fp32) |", "|---|---|---|---|---|---|---|"]
        for row in ckpt_rows:
            for fw in [fw for r, fw in labels if r == row]:
                key = (row, fw)
                if error_of(results, key):
                    lines.append(f"| {row} | {fw} | error: {error_of(results, key)} | | | | |")
                    continue
                cols = [collect(results, key, n) for n in ("save_s", "load_s", "bytes", "z2f_s")]
                ratios = ("1" if fw == "ours" else ", ".join(
                    paired_ratio(collect(results, (row, "ours"), n), collect(results, key, n))
                    for n in ("save_s", "load_s", "z2f_s")))
                lines.append(f"| {row} | {fw} | {fmt_spread(cols[0], 2)} | {fmt_spread(cols[1], 2)} | "
                             f"{fmt_spread([b / 2**20 for b in cols[2]], 1)} | {fmt_spread(cols[3], 2)} | {ratios} |")
        lines += ["", "Saves: ours fsyncs every file and renames it into place (nothing half-written survives a "
                  "crash); real DeepSpeed's torch checkpoint engine writes in place without fsync "
                  "(docs/checkpoint-speed.md)."]
    stage_ratio = []
    for model in args.models:
        base = collect(results, (f"{model}/stage0", "ours"), "step")
        for row in ("stage1", "stage2"):
            other = collect(results, (f"{model}/{row}", "ours"), "step")
            if base and other:
                stage_ratio.append(f"{model} ours {row} / ours stage0: {paired_ratio(other, base)}")
    if stage_ratio:
        lines += ["", "; ".join(stage_ratio)]
    return "\n".join(lines)


def machine_header(args: argparse.Namespace, versions: dict, started: datetime.datetime, load: float) -> str:
    import torch

    ended = datetime.datetime.now(datetime.UTC).strftime("%H:%M UTC")
    return (f"peers — {started.strftime('%Y-%m-%d %H:%M')}-{ended}, {platform.node()}, {os.cpu_count()} cores, "
            f"load average at start {load:.1f}, torch {torch.__version__}, "
            f"real DeepSpeed {versions.get('real', 'n/a')}, {args.world} gloo ranks x 1 thread, "
            f"{args.reps} reps x {args.steps} steps after {args.warmup} warm-up")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started, load = datetime.datetime.now(datetime.UTC), os.getloadavg()[0]
    pythons = {"ours": sys.executable, "ddp": sys.executable, "fsdp2": sys.executable, "hf": sys.executable}
    why_not_real = "left out (--no-real)"
    if not args.no_real:
        pythons["real"], why_not_real = real_python()
    jobs = plan(args)
    labels = list(dict.fromkeys((row, fw) for row, fw, _ in jobs))
    results: dict[tuple[str, str], list[dict]] = {}
    versions: dict[str, str] = {}
    for rep in range(args.reps):
        by_row: dict[str, list] = {}
        for row, fw, job in jobs:
            by_row.setdefault(row, []).append((fw, job))
        for row, entries in by_row.items():
            shift = rep % len(entries)  # rotate which framework of a row runs first
            for fw, job in entries[shift:] + entries[:shift]:
                python = pythons.get(fw)
                res = run_one(python, job, args.timeout, real=fw == "real") if python else {"error": why_not_real}
                if fw == "real" and res.get("deepspeed"):
                    versions["real"] = res["deepspeed"]
                results.setdefault((row, fw), []).append(res)
                shown = res.get("error") or f"{statistics.median(res['step_ms']):.1f} ms"
                print(f"[rep {rep + 1}/{args.reps}] {row:18s} {fw:6s} {shown}", file=sys.stderr, flush=True)
    print(report(results, labels, args, machine_header(args, versions, started, load)))
    if args.json:
        Path(args.json).write_text(json.dumps({f"{r}|{f}": v for (r, f), v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
