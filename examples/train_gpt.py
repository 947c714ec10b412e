"""Train a small GPT on a deterministic synthetic language with DeepSpeed, on local CPU ranks or GPUs.

Run (two CPU ranks; on a CPU machine ``--num_gpus`` is the number of local processes)::

    deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed --deepspeed_config examples/gpt_ds_config.json

Quick check (what tests/deepspeed/test_main_job.py runs): add ``--steps 10 --log_interval 1``. ZeRO stage 3
(partitioned weights) instead of the config's stage 2: add ``--zero_stage 3``.

Uses only the documented DeepSpeed API: ``deepspeed.add_config_arguments``, ``deepspeed.initialize(model=...,
model_parameters=..., training_data=..., config=...)``, ``engine(batch)``, ``engine.backward(loss)``,
``engine.step()``. Rank 0 opens with what the engine runs (ZeRO stage, precision, world size, optimizer, offload
targets; ``gpt_run_info.py``), prints the step's loss every ``--log_interval`` steps, draws a progress bar (tqdm) when
the output goes to a terminal (``--progress`` overrides), and closes with a summary (loss first -> last, held-out
loss, samples/s, peak memory per rank, a generated sample). The engine's own report every ``steps_per_print``
steps (``loss(avg of last N steps)=``) is the mean over its window, not the step's loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the gpt_* helper modules sit next to this script

from gpt_data import TOKEN_ID, VOCAB, GrammarDataset, decode  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402
from gpt_progress import ProgressBar, RunRecord, format_rows, format_summary  # noqa: E402
from gpt_run_info import run_rows  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed import comm as dist  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.utils import logger  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The example's options plus DeepSpeed's own (``--deepspeed``, ``--deepspeed_config``)."""
    parser = argparse.ArgumentParser(description="Train a small GPT on a synthetic grammar with DeepSpeed.")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed by the deepspeed launcher")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps to train (quick check: 10)")
    parser.add_argument("--log_interval", type=int, default=25, help="print a loss line every N steps")
    parser.add_argument("--num_samples", type=int, default=8192, help="training windows generated from --seed")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the training text and of the model init")
    parser.add_argument("--block_size", type=int, default=64, help="tokens per training window")
    parser.add_argument("--n_layer", type=int, default=4, help="transformer blocks")
    parser.add_argument("--n_head", type=int, default=4, help="attention heads per block")
    parser.add_argument("--d_model", type=int, default=128, help="model width")
    parser.add_argument("--progress", choices=["auto", "bar", "lines"], default="auto",
                        help="auto: a progress bar when the output is a terminal, else only the --log_interval lines")
    parser.add_argument("--zero_stage", type=int, choices=[0, 1, 2, 3], default=None,
                        help="override zero_optimization.stage of the --deepspeed_config file (3: partitioned weights)")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    for name in ("steps", "log_interval", "num_samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def _ds_config(args: argparse.Namespace) -> dict:
    """The --deepspeed_config file, with --zero_stage applied."""
    if not args.deepspeed_config:
        raise SystemExit("train_gpt.py: pass --deepspeed --deepspeed_config <file> (see the README)")
    with open(args.deepspeed_config, encoding="utf-8") as handle:
        config = json.load(handle)
    if args.zero_stage is not None:
        zero = config.setdefault("zero_optimization", {})
        zero["stage"] = args.zero_stage
        if args.zero_stage < 2:
            zero.pop("overlap_comm", None)
    return config


def _set_threads() -> None:
    # Ranks share the machine: without OMP_NUM_THREADS each would start one thread per core and oversubscribe.
    if "OMP_NUM_THREADS" not in os.environ:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))


def _global_mean(value: torch.Tensor) -> float:
    """Mean of a scalar over the data-parallel ranks (what the global batch's loss is)."""
    value = value.detach().float().reshape(1).clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: torch.Tensor) -> float:
    """Mean loss (nats/token) on held-out windows ``data``, split across ranks, averaged over all of them."""
    model.eval()
    shard = data[dist.get_rank()::dist.get_world_size()].to(next(model.parameters()).device)
    loss = model(shard)
    model.train()
    return _global_mean(loss)


def train(engine, loader, args: argparse.Namespace, record: RunRecord, bar: ProgressBar) -> None:
    """``args.steps`` optimizer steps (each ``gradient_accumulation_steps`` micro-batches); fills ``record``."""
    gas = engine.gradient_accumulation_steps()
    batches = iter(loader)
    device = engine.device
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        step_loss = 0.0
        for _ in range(gas):
            try:
                batch = next(batches)
            except StopIteration:  # a new epoch: the sampler reshuffles
                batches = iter(loader)
                batch = next(batches)
            loss = engine(batch.to(device))
            engine.backward(loss)
            engine.step()
            step_loss += _global_mean(loss) / gas
        record.step_times.append(time.perf_counter() - start)
        record.losses.append(step_loss)
        lr = engine.get_lr()[0]
        bar.update(step, step_loss, lr)
        if step % args.log_interval == 0 or step == args.steps:
            bar.log(f"step {step:4d}/{args.steps}  loss {step_loss:.4f}  lr {lr:.2e}  "
                    f"{engine.train_batch_size() / record.step_times[-1]:.1f} samples/s")


def _peak_memory_per_rank() -> tuple[list[int], str]:
    accel = get_accelerator()
    peak = torch.tensor([float(accel.max_memory_allocated())])
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, peak)
    kind = ("peak RSS = VmHWM, from get_accelerator().max_memory_allocated()" if accel.device_name() == "cpu"
            else f"{accel.device_name()} max_memory_allocated()")
    return [int(t.item()) for t in gathered], kind


def _sample(model: GPT, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    prompt = torch.tensor([TOKEN_ID["the"]], device=device)
    model.eval()
    text = decode(model.generate(prompt, 24, generator=gen if device.type == "cpu" else None))
    model.train()
    return text


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _set_threads()
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    cfg = GPTConfig(vocab_size=len(VOCAB), block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    d_model=args.d_model)
    model = GPT(cfg)
    dataset = GrammarDataset(args.num_samples, args.block_size, seed=args.seed)
    held_out = GrammarDataset(64, args.block_size, seed=args.seed + 1).windows

    n_params = model.num_parameters()  # before ZeRO-3 partitions the weights
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=dataset, config=_ds_config(args))
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:  # what the engine runs, read back from it: --zero_stage and config edits show here
        flag = "" if args.zero_stage is None else f" with --zero_stage {args.zero_stage}"
        source = args.deepspeed_config + flag
        rows = {"config": source, **run_rows(engine, world, dist.get_backend())}
        print(format_rows("run", rows), flush=True)
    print(f"rank {rank}/{world} ready on {engine.device}: {len(loader)} micro-batches of "
          f"{engine.train_micro_batch_size_per_gpu()} per epoch, {torch.get_num_threads()} threads", flush=True)

    record = RunRecord(eval_before=evaluate(engine.module, held_out))
    interactive = {"auto": None, "bar": True, "lines": False}[args.progress]
    bar = ProgressBar(args.steps, enabled=rank == 0, interactive=interactive)
    with bar.redirect_logging(logger):  # the engine's steps_per_print lines go above the bar, not into it
        train(engine, loader, args, record, bar)
    bar.close()
    record.eval_after = evaluate(engine.module, held_out)
    record.peak_bytes, memory_kind = _peak_memory_per_rank()
    record.sample_text = _sample(engine.module, args.seed)  # every rank: ZeRO-3 gathers weights collectively
    if rank == 0:
        header = {
            "model": f"GPT {cfg.n_layer} layers x {cfg.n_head} heads, d_model {cfg.d_model}, "
                     f"{n_params / 1e6:.2f} M parameters, vocab {cfg.vocab_size}",
            "data": f"synthetic grammar (seed {args.seed}), {len(dataset)} windows x {args.block_size + 1} tokens; "
                    f"held-out: {len(held_out)} windows (seed {args.seed + 1})",
            "ranks": f"{world} ({dist.get_backend()}), global batch {engine.train_batch_size()} = micro "
                     f"{engine.train_micro_batch_size_per_gpu()} x GAS {engine.gradient_accumulation_steps()} "
                     f"x {world} ranks, {args.steps} steps",
        }
        print(format_summary(record, header, engine.train_batch_size(), memory_kind), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
