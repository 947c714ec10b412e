"""Training throughput of the DeepSpeed engine (ZeRO stage 0, fp32) against plain torch DistributedDataParallel.

Both train the main job's GPT (examples/gpt_model.py) on the same batches, in the same ranks (gloo, CPU by
default), one after the other: every repetition times ``--steps`` optimizer steps of each variant, in a rotating
order so neither always runs first. Variants:

* ``ddp``: ``DistributedDataParallel`` + ``torch.optim.AdamW`` (the baseline);
* ``engine``: ``deepspeed.initialize`` with the optimizer built from the config (``"type": "AdamW"``);
* ``engine+torch-opt``: ``deepspeed.initialize`` given the same ``torch.optim.AdamW`` as DDP (engine overhead only).

Reported: median global samples/s over the repetitions (min-max in brackets), the ratio of the medians to
DDP's, and the median of the per-repetition ratios to the adjacent DDP run (target >= 0.95x).
Run: ``python benchmarks/train_step.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import cpu_model, paired, spawn_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt_data import VOCAB, GrammarDataset  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402

OPTIM = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world_size", type=int, default=2, help="ranks (processes)")
    parser.add_argument("--reps", type=int, default=21, help="timed repetitions per variant (interleaved)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per repetition")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant before the first rep")
    parser.add_argument("--micro_batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--block_size", type=int, default=64)
    args = parser.parse_args(argv)
    for name in ("world_size", "reps", "steps", "micro_batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def _model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)  # every variant and rank starts from the same weights
    return GPT(GPTConfig(vocab_size=len(VOCAB), block_size=args.block_size, n_layer=args.n_layer,
                         n_head=4, d_model=args.d_model))


def _ds_config(args: argparse.Namespace, with_optimizer: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
    }
    if with_optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {**OPTIM, "betas": list(OPTIM["betas"])}}
    return config


class DDPStep:
    """The baseline: one DDP forward/backward and a torch AdamW step per call."""

    name = "ddp"

    def __init__(self, args: argparse.Namespace) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.model = DistributedDataParallel(_model(args))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **OPTIM)
        self.optimizer_name = type(self.optimizer).__name__

    def __call__(self, batch: torch.Tensor) -> None:
        loss = self.model(batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class EngineStep:
    """``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``; optimizer from the config or given."""

    def __init__(self, args: argparse.Namespace, client_optimizer: bool) -> None:
        import deepspeed

        model = _model(args)
        optimizer = torch.optim.AdamW(model.parameters(), **OPTIM) if client_optimizer else None
        self.name = "engine+torch-opt" if client_optimizer else "engine"
        self.engine, built, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                        optimizer=optimizer,
                                                        config=_ds_config(args, not client_optimizer))
        inner = getattr(built, "optimizer", built)  # wrappers keep the torch optimizer in .optimizer
        self.optimizer_name = type(inner).__name__

    def __call__(self, batch: torch.Tensor) -> None:
        loss = self.engine(batch)
        self.engine.backward(loss)
        self.engine.step()


def _time_steps(variant, batches: list[torch.Tensor], steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds of this rank for ``steps`` steps, from a barrier to the barrier after the last step.

    CPU time (all threads of the process, gloo's included) does not grow when other processes take the cores,
    so it still compares the variants' work on a loaded machine, where wall time mostly measures the load.
    """
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(steps):
        variant(batches[i % len(batches)])
    dist.barrier()
    return time.perf_counter() - start, time.process_time() - cpu_start


def _rank_main(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.world_size),
                      LOCAL_WORLD_SIZE=str(args.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    dist.init_process_group("gloo")
    data = GrammarDataset(args.micro_batch * args.world_size * 8, args.block_size, seed=1234).windows
    batches = list(data[rank::args.world_size].split(args.micro_batch))
    variants = [DDPStep(args), EngineStep(args, client_optimizer=False), EngineStep(args, client_optimizer=True)]
    for variant in variants:
        _time_steps(variant, batches, args.warmup)
    times: dict[str, list[tuple[float, float]]] = {v.name: [] for v in variants}
    for rep in range(args.reps):
        shift = rep % len(variants)  # rotate the order: no variant always runs first (warm caches) or last
        for variant in variants[shift:] + variants[:shift]:
            times[variant.name].append(_time_steps(variant, batches, args.steps))
    if rank == 0:
        queue.put((times, {v.name: v.optimizer_name for v in variants}))
    dist.destroy_process_group()




def run(args: argparse.Namespace) -> tuple[dict[str, list[tuple[float, float]]], dict[str, str]]:
    """Start the ranks; returns rank 0's per-repetition (wall, CPU) seconds and optimizer class per variant."""
    return spawn_ranks(_rank_main, args, args.world_size)






def report(args: argparse.Namespace, times: dict[str, list[tuple[float, float]]], optimizers: dict[str, str]) -> str:
    """The table: median global samples/s per variant [min-max], ratios to DDP, CPU ms per step.

    Paired ratios compare each repetition with the DDP run of the same repetition (adjacent in time), so load
    from other processes that drifts over the run cancels out; they are the figures to judge by.
    """
    samples = args.steps * args.micro_batch * args.world_size
    wall = {name: [w for w, _ in ts] for name, ts in times.items()}
    cpu = {name: [c for _, c in ts] for name, ts in times.items()}
    base = statistics.median(samples / t for t in wall["ddp"])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        f"train step throughput: engine (ZeRO stage 0, fp32) vs torch DDP, {args.world_size} ranks, gloo, CPU",
        f"machine: {os.cpu_count()} cores ({cpu_model()}), torch {torch.__version__}, python "
        f"{platform.python_version()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, "
        f"load average (1 min) at the end {load:.2f}",
        f"model: GPT {args.n_layer} layers, d_model {args.d_model}, block {args.block_size}; micro batch "
        f"{args.micro_batch}/rank; {args.reps} interleaved reps x {args.steps} steps (after {args.warmup} warm-up)",
        "",
        f"{'variant':<17} {'optimizer':<10} {'samples/s':>9} {'[min - max]':>15} {'ratio':>7} {'paired':>7} "
        f"{'CPU ms/step':>11} {'CPU paired':>10}",
    ]
    for name in times:
        rates = sorted(samples / t for t in wall[name])
        med = statistics.median(rates)
        cpu_ms = 1000 * statistics.median(cpu[name]) / args.steps
        lines.append(f"{name:<17} {optimizers[name]:<10} {med:>9.1f} {f'[{rates[0]:.0f} - {rates[-1]:.0f}]':>15} "
                     f"{med / base:>6.3f}x {paired(wall['ddp'], wall[name]):>6.3f}x {cpu_ms:>11.1f} "
                     f"{paired(cpu['ddp'], cpu[name]):>9.3f}x")
    lines += ["",
              "samples/s: global, median over reps (wall clock); ratio: of the medians to ddp's; paired: median of",
              "per-rep ratios to the adjacent ddp run; CPU: rank 0 process CPU time. Higher ratio = faster than ddp.",
              "target: engine >= 0.95x ddp"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    times, optimizers = run(args)
    print(report(args, times, optimizers))


if __name__ == "__main__":
    main()
