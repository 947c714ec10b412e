"""The DeepSpeed Autotuner on the main job: a ``fast`` tuning run of examples/train_gpt.py on 2 CPU ranks, then
the chosen config against the job's default config (examples/gpt_ds_config.json), measured in the same run.

Steps: (1) ``deepspeed --num_gpus 2 --autotuning tune examples/train_gpt.py --deepspeed --deepspeed_config
<tuning config>``, where the tuning config is the default config with ``zero_optimization.stage`` a list of all
stages, the default's first (so the Autotuner measures the default itself as its baseline experiment and chooses
among candidates that include it), and an ``autotuning`` section (``fast``, ``max_train_batch_size``); its wall
time must stay under ``--budget_s`` (600 s) and it must write the documented files; its summary gives the
in-run optimal/baseline ratio. (2) The default config and ``ds_config_optimal.json`` each train through the
launcher ``--repeats`` times, alternating, timed by the same engine probe the Autotuner uses (steps 3..20).
Reported: global samples/s (median, min-max, best) and optimal/default as the median of the per-repetition
ratios (adjacent runs, so drifting load cancels) and best-of-N (target >= 1.0: the chosen config is at least
as fast). On a shared, loaded machine the spread is wide: the load average is printed, and the samples per
CPU-second of rank 0 (the probe's ``cpu_latency``) are given as a load-insensitive cross-check.
Run: ``python benchmarks/autotuning.py`` (``--help`` for options); ``hatch run bench:autotuning``.
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
from pathlib import Path

import torch
from _common import cpu_model, free_port, paired

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
DEFAULT_CONFIG = ROOT / "examples" / "gpt_ds_config.json"
DOCUMENTED = ("ds_config_optimal.json", "cmd_optimal.txt", "summary.txt", "profile_model_info/model_info.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=None, help="where the results go (default: a fresh temp folder)")
    parser.add_argument("--max_train_batch_size", type=int, default=64, help="autotuning.max_train_batch_size")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each config after tuning")
    parser.add_argument("--budget_s", type=float, default=600.0, help="the tuning run must finish within this")
    parser.add_argument("--end_profile_step", type=int, default=10, help="autotuning.end_profile_step while tuning")
    return parser.parse_args(argv)


def _launch(workdir: Path, config: Path, extra: list[str], timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           *extra, str(SCRIPT), "--deepspeed", "--deepspeed_config", str(config), "--progress", "lines"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)


def tune(workdir: Path, args: argparse.Namespace) -> tuple[float, Path]:
    """Run the tuning job; returns (wall seconds, results folder)."""
    config = json.loads(DEFAULT_CONFIG.read_text())
    stage = config["zero_optimization"]["stage"]
    config["zero_optimization"]["stage"] = [stage] + [s for s in range(4) if s != stage]  # the default's first
    config["autotuning"] = {"enabled": True, "fast": True, "metric": "throughput", "start_profile_step": 3,
                            "end_profile_step": args.end_profile_step,
                            "max_train_batch_size": args.max_train_batch_size}
    path = workdir / "tune_config.json"
    path.write_text(json.dumps(config, indent=2))
    started = time.perf_counter()
    proc = _launch(workdir, path, ["--autotuning", "tune"], timeout=args.budget_s + 120)
    wall = time.perf_counter() - started
    (workdir / "tune.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"the tuning run failed (exit {proc.returncode}); see {workdir / 'tune.log'}")
    return wall, workdir / "autotuning_results"


def measure(workdir: Path, name: str, config: dict, repeat: int) -> tuple[float, float]:
    """(global samples/s, global samples per CPU-second of rank 0) of ``config`` over steps 3..20, timed by the
    engine's autotuning probe."""
    metric = workdir / f"measure_{name}_{repeat}.json"
    config = {**config, "autotuning": {"enabled": True, "start_profile_step": 3, "end_profile_step": 20,
                                       "metric_path": str(metric)}}
    path = workdir / f"measure_{name}.json"
    path.write_text(json.dumps(config))
    proc = _launch(workdir, path, [], timeout=600)
    if proc.returncode != 0 or not metric.exists():
        raise SystemExit(f"measuring {name} failed:\n{proc.stderr[-2000:]}")
    metrics = json.loads(metric.read_text())
    return metrics["throughput"], metrics["train_batch_size"] / (metrics["cpu_latency"] / 1e3)


def _describe(config: dict) -> str:
    return (f"stage {config['zero_optimization']['stage']}, micro {config['train_micro_batch_size_per_gpu']} x "
            f"gas {config.get('gradient_accumulation_steps', 1)} x 2 ranks")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ds_autotuning_bench_"))
    if args.workdir and workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"# autotuning benchmark: {datetime.date.today()}, {cpu_model()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, python {platform.python_version()}; workdir {workdir}", flush=True)
    wall, results = tune(workdir, args)
    missing = [f for f in DOCUMENTED if not (results / f).exists()]
    experiments = sorted(p.name for p in (workdir / "autotuning_exps").glob("*.json"))
    summary = (results / "summary.txt").read_text()
    print(summary)
    default = json.loads(DEFAULT_CONFIG.read_text())
    expected = (f"z{default['zero_optimization']['stage']}_gas{default.get('gradient_accumulation_steps', 1)}"
                f"_tmbspg{default['train_micro_batch_size_per_gpu']}")
    measured = f"baseline (the user's config): {expected}" in summary
    print(f"the default config was measured in the tuning run as its baseline ({expected}): "
          f"{'yes' if measured else 'NO'}")
    print(f"tuning run: {wall:.0f} s wall for {len(experiments)} experiments (budget {args.budget_s:.0f} s): "
          f"{'OK' if wall <= args.budget_s else 'OVER BUDGET'}; documented files "
          f"{'all written' if not missing else 'MISSING ' + ', '.join(missing)}")

    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    rates: dict[str, list[float]] = {"default": [], "optimal": []}
    cpu_rates: dict[str, list[float]] = {"default": [], "optimal": []}
    for repeat in range(args.repeats):  # alternate, so drifting machine load hits both alike
        for name, config in (("default", default), ("optimal", optimal))[:: 1 if repeat % 2 == 0 else -1]:
            wall_rate, cpu_rate = measure(workdir, name, config, repeat)
            rates[name].append(wall_rate)
            cpu_rates[name].append(cpu_rate)
    base, best_base = statistics.median(rates["default"]), max(rates["default"])
    print("\n| config  | setting" + " " * 30 + "| samples/s median [min-max] | best   | ratio (median, best) |")
    print("|---------|" + "-" * 38 + "|----------------------------|--------|----------------------|")
    for name, config in (("default", default), ("optimal", optimal)):
        r = rates[name]
        med = statistics.median(r)
        spread = f"{med:.1f} [{min(r):.1f}-{max(r):.1f}]"
        print(f"| {name:<7} | {_describe(config):<36} | {spread:<26} | {max(r):6.1f} | "
              f"{med / base:.2f}x, {max(r) / best_base:.2f}x{'':<9}|")
    ratio = paired(rates["optimal"], rates["default"])
    print(f"\noptimal / default: median of the {args.repeats} paired ratios = {ratio:.2f}x, best-of-{args.repeats} "
          f"ratio = {max(rates['optimal']) / best_base:.2f}x ({'>= 1.0: OK' if ratio >= 1.0 else 'below 1.0'}); "
          f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    cpu_ratio = paired(cpu_rates["optimal"], cpu_rates["default"])
    print(f"samples per CPU-second of rank 0 (less sensitive to other load): default "
          f"{statistics.median(cpu_rates['default']):.1f}, optimal {statistics.median(cpu_rates['optimal']):.1f}, "
          f"median paired ratio {cpu_ratio:.2f}x")

if __name__ == "__main__":
    main()
