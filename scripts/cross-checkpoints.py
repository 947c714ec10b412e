"""Cross checkpoints between this project and the real DeepSpeed, both ways, and compare the continued losses.

For each case (ZeRO stage, precision, offload, MoE, pipeline) and each direction, engine A (one framework) trains
N steps on 2 gloo ranks, saves, and trains M more steps (its own continuation); engine B (the other framework)
builds the same model from *another* seed (so a load that silently does nothing shows), loads A's checkpoint and
trains M steps on the same data. B's M losses are compared with A's last M losses, on every rank.

Usage (the project's python, e.g. ``bash scripts/hatch run test:python scripts/cross-checkpoints.py``):
    scripts/cross-checkpoints.py [--cases a,b,...] [--steps N M] [--no-doc]
The real DeepSpeed's python comes from ``scripts/real-deepspeed-venv.sh`` (built once). Prints a table
(case | ours->DS | DS->ours | max loss diff) and writes docs/cross-checkpoints.md unless ``--no-doc``.
A benchmark-style check, not part of the CI suite: it needs the side venv and takes minutes.

The worker half (``--worker``) imports only torch and whichever ``deepspeed`` its interpreter holds, so the same
file runs in both environments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH, BATCH = 16, 4
TOL = 0.0  # losses must agree exactly ("to every printed digit"); the table shows the largest difference

_ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01,
                                      "torch_adam": True}}
_SCHED = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 6}}


def _zero(stage: int, **extra: object) -> dict:
    return {"stage": stage, **extra}


# name -> (ds config overrides, model kind)
CASES: dict[str, tuple[dict, str]] = {
    "stage0-fp32": ({"zero_optimization": _zero(0)}, "mlp"),
    "stage0-fp16": ({"zero_optimization": _zero(0), "fp16": {"enabled": True, "initial_scale_power": 8}}, "mlp"),
    "stage0-bf16": ({"zero_optimization": _zero(0), "bf16": {"enabled": True}}, "mlp"),
    "stage1-bf16": ({"zero_optimization": _zero(1), "bf16": {"enabled": True}}, "mlp"),
    "stage1-fp32": ({"zero_optimization": _zero(1)}, "mlp"),
    "stage2-fp32": ({"zero_optimization": _zero(2)}, "mlp"),
    "stage2-bf16": ({"zero_optimization": _zero(2), "bf16": {"enabled": True}}, "mlp"),
    "stage2-fp16": ({"zero_optimization": _zero(2), "fp16": {"enabled": True, "initial_scale_power": 8}}, "mlp"),
    "stage2-offload": ({"zero_optimization": _zero(2, offload_optimizer={"device": "cpu"}),
                        "zero_force_ds_cpu_optimizer": False}, "mlp"),
    "stage3-fp32": ({"zero_optimization": _zero(3)}, "mlp"),
    "stage3-offload": ({"zero_optimization": _zero(3, offload_optimizer={"device": "cpu"},
                                                   offload_param={"device": "cpu"}),
                        "zero_force_ds_cpu_optimizer": False}, "mlp"),
    "stage3-bf16": ({"zero_optimization": _zero(3), "bf16": {"enabled": True}}, "mlp"),
    "moe-ep2-stage0": ({"zero_optimization": _zero(0)}, "moe"),
    "moe-ep2-stage2": ({"zero_optimization": _zero(2)}, "moe"),
    # clipping off: DeepSpeed >= 0.19.3 clips at 1.0 by default, and its fp32 pipeline norm counts only the first
    # stage (docs/deviations.md, "Pipeline parallelism"); this case is about the checkpoint crossing
    "pipe-2stages": ({"zero_optimization": _zero(0), "gradient_clipping": 0.0}, "pipe"),
}


# ----------------------------------------------------------------------------------------------- worker half
def _worker(args: argparse.Namespace) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.dump_traceback_later(args.timeout - 15, exit=True)  # a hang shows where it waits
    torch.set_num_threads(1)
    import deepspeed

    overrides, kind = CASES[args.case]
    # gradient_clipping given: DeepSpeed 0.19.3+ clips at 1.0 when it is left out, this project keeps the documented
    # 0 (docs/deviations.md); the comparison is of the checkpoints, not of that default
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "optimizer": _ADAMW,
              "scheduler": _SCHED, "steps_per_print": 10**6, "wall_clock_breakdown": False, "gradient_clipping": 0.0,
              **overrides}
    if args.universal:  # the load side reads a universal checkpoint (scripts/cross-universal.py)
        config["checkpoint"] = {"load_universal": True}
    if kind == "pipe":
        config["train_batch_size"] = BATCH * 2  # micro batch 4, 2 micro batches, dp 1
        config["gradient_accumulation_steps"] = 2
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    seed = 1234 if args.phase == "save" else 999  # B starts from other weights: only the load can fix them
    torch.manual_seed(seed)
    model = _build(kind, torch, deepspeed)
    params = _param_groups(model, kind, deepspeed)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    dtype = torch.bfloat16 if "bf16" in overrides else torch.float16 if "fp16" in overrides else torch.float32
    losses: list[float] = []
    if args.phase == "save":
        for step in range(args.n):
            losses.append(_train_step(engine, kind, step, rank, dtype, torch))
        engine.save_checkpoint(args.dir, tag="cross")
        dist.barrier()
        for step in range(args.n, args.n + args.m):
            losses.append(_train_step(engine, kind, step, rank, dtype, torch))
    else:
        path, _ = engine.load_checkpoint(args.dir, tag=args.tag)
        if path is None:
            raise RuntimeError(f"load_checkpoint({args.dir!r}) loaded nothing")
        for step in range(args.n, args.n + args.m):
            losses.append(_train_step(engine, kind, step, rank, dtype, torch))
    with open(f"{args.out}.{rank}", "w") as handle:
        json.dump(losses, handle)
    dist.barrier()


def _build(kind: str, torch, deepspeed):  # noqa: ANN001, ANN202 - torch/deepspeed of whichever venv runs
    nn = torch.nn

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2, self.l3 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH), nn.Linear(WIDTH, 1)

        def forward(self, x, y):  # noqa: ANN001, ANN202
            x = x.to(self.l1.weight.dtype)
            out = self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))
            return nn.functional.mse_loss(out.float(), y.float())

    class MoENet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            from deepspeed.moe.layer import MoE

            self.l1 = nn.Linear(WIDTH, WIDTH)
            self.moe = MoE(hidden_size=WIDTH, expert=nn.Linear(WIDTH, WIDTH), num_experts=2, ep_size=2, k=1,
                           capacity_factor=4.0, eval_capacity_factor=4.0, min_capacity=BATCH, drop_tokens=False)
            self.head = nn.Linear(WIDTH, 1)

        def forward(self, x, y):  # noqa: ANN001, ANN202
            h, aux, _ = self.moe(torch.tanh(self.l1(x.to(self.l1.weight.dtype))))
            return nn.functional.mse_loss(self.head(h).float(), y.float()) + 0.01 * aux

    if kind == "mlp":
        return MLP()
    if kind == "moe":
        return MoENet()
    from deepspeed.pipe import LayerSpec, PipelineModule

    layers = [LayerSpec(nn.Linear, WIDTH, 2 * WIDTH), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 2 * WIDTH, WIDTH),
              LayerSpec(nn.Tanh), LayerSpec(nn.Linear, WIDTH, 1)]
    return PipelineModule(layers=layers, num_stages=2, loss_fn=lambda out, y: nn.functional.mse_loss(out, y),
                          partition_method="uniform")


def _param_groups(model, kind: str, deepspeed):  # noqa: ANN001, ANN202
    if kind != "moe":
        return [p for p in model.parameters() if p.requires_grad]
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters()], "name": "params"})


def _batch(step: int, rank: int, torch):  # noqa: ANN001, ANN202
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    return x, x.sum(dim=1, keepdim=True).sin()


def _train_step(engine, kind: str, step: int, rank: int, dtype, torch) -> float:  # noqa: ANN001
    if kind == "pipe":  # every stage reads the same micro batches (the first stage uses x, the last y)
        batches = iter([_batch(2 * step + i, 0, torch) for i in range(2)])
        return float(engine.train_batch(data_iter=batches))
    x, y = _batch(step, rank, torch)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return float(loss)


# ----------------------------------------------------------------------------------------------- driver half
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(python: str, case: str, phase: str, folder: str, n: int, m: int, timeout: float,
            extra: tuple[str, ...] = ()) -> tuple[list, str]:
    """Run 2 ranks of the worker (``phase``: save or load, "load-<label>" naming its logs apart; ``extra``: more
    worker arguments); returns (losses per rank, or None on failure; the failure's last lines)."""
    out = os.path.join(folder, f"losses-{phase}")
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
               "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}
        cmd = [python, os.path.abspath(__file__), "--worker", "--case", case, "--phase", phase.split("-")[0],
               "--dir", os.path.join(folder, "ckpt"), "--out", out, "--steps", str(n), str(m),
               "--timeout", str(timeout), *extra]
        log = open(os.path.join(folder, f"{phase}-{rank}.log"), "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=folder), log))
    deadline = time.monotonic() + timeout
    for proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    if all(proc.returncode == 0 for proc, _ in procs):
        return [json.load(open(f"{out}.{rank}")) for rank in range(2)], ""
    return None, _failure(folder, phase, [proc.returncode for proc, _ in procs])


def _failure(folder: str, phase: str, codes: list) -> str:
    """The most telling error line of the failed ranks' logs."""
    for rank in range(2):
        text = open(os.path.join(folder, f"{phase}-{rank}.log")).read().strip().splitlines()
        if any(line.startswith("Timeout (") for line in text):  # faulthandler's dump: where the main thread waited
            frames = [line.strip() for line in text if line.strip().startswith("File ")]
            return f"timed out (hung or too slow); main thread at {frames[0] if frames else '?'}"[:200]
        errors = [line for line in text if "Error" in line or "error" in line or "Exception" in line]
        if errors:
            return errors[-1].strip()[:160]
    return f"exit codes {codes}"


def _cross(case: str, src: str, dst: str, n: int, m: int, keep: str | None, label: str, timeout: float) -> dict:
    folder = tempfile.mkdtemp(prefix=f"cross-{case}-")
    try:
        ref, error = _launch(src, case, "save", folder, n, m, timeout)
        if ref is None:
            return {"ok": False, "why": f"save side failed: {error}"}
        got, error = _launch(dst, case, "load", folder, n, m, timeout)
        if got is None:
            return {"ok": False, "why": f"load side failed: {error}"}
        diff = max(abs(a - b) for r in range(2) for a, b in zip(ref[r][n:], got[r], strict=True))
        return {"ok": diff <= TOL, "diff": diff, "ref": ref[0][n:], "got": got[0],
                "why": "" if diff <= TOL else f"losses differ (max {diff:.3g})"}
    finally:
        if keep:
            shutil.copytree(folder, os.path.join(keep, f"{case}-{label}"),
                            dirs_exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)


def _real_python() -> str:
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "real-deepspeed-venv.sh")], check=True,
                         capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1]


def _prebuild(python: str) -> None:
    """Build DeepSpeed's CPU shared-memory comm op (JIT, at ``init_distributed``) in one process first: two ranks
    building it at once, or a rank killed mid-build, leave torch's build lock behind and later ranks wait on it."""
    code = ("from deepspeed.accelerator import get_accelerator\n"
            "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
            "b is None or b.load()")
    subprocess.run([python, "-c", code], capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"},
                   timeout=900)


def _version(python: str) -> str:
    code = "import deepspeed, torch; print(deepspeed.__version__, torch.__version__)"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"}).stdout
    return out.strip().splitlines()[-1] if out.strip() else "?"


def _cell(result: dict) -> str:
    return "loads, same losses" if result["ok"] else result["why"].replace("|", "/")


def _report(rows: list, ours: str, real: str, n: int, m: int) -> list[str]:
    lines = ["| case | ours -> DS | DS -> ours | max loss diff |", "|---|---|---|---|"]
    for case, a, b in rows:
        diffs = [r["diff"] for r in (a, b) if "diff" in r]
        lines.append(f"| {case} | {_cell(a)} | {_cell(b)} | {max(diffs):.3g} |" if diffs else
                     f"| {case} | {_cell(a)} | {_cell(b)} | - |")
    head = [f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {os.cpu_count()} "
            f"cores, {platform.platform()}", f"ours: deepspeed {ours}; real: deepspeed {real} (DS_ACCELERATOR=cpu)",
            f"2 gloo ranks, AdamW (torch_adam) + WarmupLR, N={n} steps then save, M={m} continued steps", ""]
    return head + lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case")
    parser.add_argument("--phase", choices=["save", "load"])
    parser.add_argument("--dir")
    parser.add_argument("--out")
    parser.add_argument("--tag", default="cross", help=argparse.SUPPRESS)  # the tag the load side reads
    parser.add_argument("--universal", action="store_true", help=argparse.SUPPRESS)  # ... as a universal checkpoint
    parser.add_argument("--steps", nargs=2, type=int, default=[4, 4], metavar=("N", "M"))
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    parser.add_argument("--no-doc", action="store_true", help="do not write docs/cross-checkpoints.md")
    parser.add_argument("--direction", choices=["both", "to-ds", "to-ours"], default="both")
    parser.add_argument("--timeout", type=float, default=420, help="seconds per 2-rank launch")
    parser.add_argument("--keep", help="copy each case's checkpoints and logs under this folder")
    args = parser.parse_args()
    args.n, args.m = args.steps
    if args.worker:
        _worker(args)
        return
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; accepted: {', '.join(CASES)}")
    ours, real = sys.executable, _real_python()
    _prebuild(real)
    versions = _version(ours), _version(real)
    rows = []
    for case in args.cases.split(","):
        skipped = {"ok": False, "why": "not run (--direction)"}
        to_real = (_cross(case, ours, real, args.n, args.m, args.keep, "ours-to-ds", args.timeout)
                   if args.direction != "to-ours" else skipped)
        to_ours = (_cross(case, real, ours, args.n, args.m, args.keep, "ds-to-ours", args.timeout)
                   if args.direction != "to-ds" else skipped)
        rows.append((case, to_real, to_ours))
        print(f"{case}: ours->DS {_cell(to_real)}; DS->ours {_cell(to_ours)}", flush=True)
    lines = _report(rows, *versions, args.n, args.m)
    print("\n".join(lines))
    if not args.no_doc:
        _write_doc(lines)
    sys.exit(0 if all(a["ok"] and b["ok"] for _, a, b in rows) else 1)


def _write_doc(lines: list[str]) -> None:
    text = ["# Checkpoints crossing to and from the real DeepSpeed", "",
            "Measured by `bash scripts/hatch run test:python scripts/cross-checkpoints.py` (see its docstring): for "
            "each case, one framework trains N steps, saves and continues M steps; the other builds the model from "
            "another seed, loads the checkpoint and trains the same M steps. \"same losses\" means every rank's M "
            "losses are equal (difference 0).", "",
            "Universal checkpoints (real DeepSpeed's `ds_to_universal` on our files): `docs/cross-universal.md`.", "",
            *lines, ""]
    with open(os.path.join(ROOT, "docs", "cross-checkpoints.md"), "w") as handle:
        handle.write("\n".join(text))


if __name__ == "__main__":
    main()
