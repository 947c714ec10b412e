"""AutoSP (``compile: {deepcompile: true, passes: ["autosp"]}``) with the Inductor backend: a small SDPA language
model trained with its sequence split over 2 ranks against the same model compiled in one process.

Model: ``--layers`` pre-norm blocks (``--hidden``, ``--heads``, SDPA with a causal-and-padding boolean mask built
from the position ids and the whole 2-D padding mask), token and position embeddings, a vocabulary head and mean
cross entropy, all in the compiled graph; batch ``--batch`` x ``--seq`` tokens, fp32, SGD. Baseline: one rank,
``engine.compile(backend="inductor")`` without AutoSP (plain torch.compile), the whole sequence. AutoSP: 2 ranks,
``sequence_parallel_size`` 2, each rank's shard of the marked inputs (``prepare_autosp_inputs``), with AutoSP's memory
optimization (selective activation checkpointing: matmuls recomputed, attention kept) and, as a third run, without
it. All run through ``deepspeed.initialize``; ranks from the shared test harness, 1 torch thread per rank.
``--steps`` steps; the first (compilation) is reported on its own, the rest timed (median ms per step, the slowest
rank's). Checked: AutoSP's losses (mean over ranks of each rank's shard loss) equal the baseline's (max |diff|
reported). "saved act MiB": the bytes of the tensors the last step's forward saved for backward on rank 0
(``saved_tensors_hooks``), parameters left out.

Run: ``python benchmarks/autosp.py`` (``--quick`` for a short run).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import sys
import time
from pathlib import Path

TESTS_DIR = str(Path(__file__).resolve().parents[1] / "tests")
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import int_options  # noqa: E402
from _harness import run_distributed, shutdown_pool  # noqa: E402


class _Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(self.norm2(x))


class _LM(torch.nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.embed, self.pos = torch.nn.Embedding(args.vocab, args.hidden), torch.nn.Embedding(args.seq, args.hidden)
        self.blocks = torch.nn.ModuleList(_Block(args.hidden, args.heads) for _ in range(args.layers))
        self.head = torch.nn.Linear(args.hidden, args.vocab)

    def forward(self, batch: tuple) -> torch.Tensor:
        ids, labels, positions, padding = batch
        keys = torch.arange(padding.shape[1], device=padding.device)
        mask = (positions[:, None, :, None] >= keys) & padding[:, None, None, :].bool()
        x = self.embed(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x, mask)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _batch(args: argparse.Namespace, step: int) -> tuple:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    padding = torch.ones(args.batch, args.seq, dtype=torch.long)
    padding[-1, : args.seq // 8] = 0
    return ids, labels, torch.arange(args.seq).expand(args.batch, args.seq), padding


def _saved_activation_bytes(engine: object, forward: object) -> tuple:
    """``forward()``'s result and the bytes of the tensors it saved for backward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    saved = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return out, sum(saved.values())


def _run(args: argparse.Namespace, memory_optimization: bool = True) -> dict:
    import deepspeed
    from deepspeed.compile.passes import long_context_checkpointing
    from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs

    world = dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": args.batch, "steps_per_print": 10**6, "sequence_parallel_size": world,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if world > 1:
        config["compile"] = {"deepcompile": True, "passes": ["autosp"]}
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=_LM(args), config=config)
    long_context_checkpointing.enabled = memory_optimization
    try:
        engine.compile(backend="inductor")
    finally:
        long_context_checkpointing.enabled = True
    losses, times = [], []
    for step in range(args.steps):
        batch = _batch(args, step)
        dist.barrier()
        start = time.perf_counter()
        inputs = prepare_autosp_inputs(*batch) if world > 1 else batch
        loss, saved = _saved_activation_bytes(engine, functools.partial(engine, inputs))
        engine.backward(loss)
        engine.step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        times.append(elapsed.item() * 1e3)
    return {"losses": losses, "first_ms": times[0], "step_ms": statistics.median(times[1:]), "saved": saved}


def main() -> None:
    parser = int_options(argparse.ArgumentParser(description=__doc__.splitlines()[0]), hidden=256, heads=8,
                         layers=2, vocab=1000, seq=1024, batch=2, steps=6)
    parser.add_argument("--quick", action="store_true", help="hidden 64, seq 256, 3 steps")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.seq, args.steps = 64, 256, 3
    print(f"# AutoSP (inductor) | {datetime.date.today()} | torch {torch.__version__} | {os.cpu_count()} cores "
          f"({platform.processor() or platform.machine()}), 1 thread per rank")
    print(f"# {args.layers} layers, hidden {args.hidden}, heads {args.heads}, batch {args.batch}, seq {args.seq}, "
          f"vocab {args.vocab}, fp32, SGD, {args.steps} steps")
    try:
        base = run_distributed(_run, world_size=1, args=(args,), timeout=1800)[0]
        autosp = run_distributed(_run, world_size=2, args=(args,), timeout=1800)[0]
        plain = run_distributed(_run, world_size=2, args=(args, False), timeout=1800)[0]
    finally:
        shutdown_pool()
    tokens = args.batch * args.seq
    print(f"{'run':<36}{'first step ms':>15}{'step ms':>10}{'tokens/s':>11}{'vs base':>9}{'saved act MiB':>15}")
    runs = (("1 rank, torch.compile", base), ("2 ranks, AutoSP sp=2", autosp),
            ("2 ranks, AutoSP sp=2, no memory opt", plain))
    for name, result in runs:
        print(f"{name:<36}{result['first_ms']:>15.0f}{result['step_ms']:>10.1f}"
              f"{tokens / result['step_ms'] * 1e3:>11.0f}{base['step_ms'] / result['step_ms']:>9.2f}"
              f"{result['saved'] / 2**20:>15.2f}")
    for name, result in runs[1:]:
        diff = max(abs(a - b) for a, b in zip(result["losses"], base["losses"], strict=True))
        print(f"losses equal ({name}): max |AutoSP - base| = {diff:.2e} over {args.steps} steps")
    print(f"saved activations per rank, memory optimization on / off: {autosp['saved'] / plain['saved']:.2f}")


if __name__ == "__main__":
    main()
