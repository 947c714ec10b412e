"""Inference engine (``ds_inference.init_inference``): generate throughput against the plain Hugging Face model,
tensor-parallel latency, int8 weight memory.

Model: a randomly initialised GPT-2 (``--hidden``, ``--layers``, ``--heads``, ``--vocab``; built from a config, no
download), eval mode, fp32 unless stated. Every process runs 1 torch thread, so tp 2 uses two cores where tp 1
uses one.

1. Overhead at tp 1. Greedy ``generate`` of ``--new`` tokens after a ``--prompt``-token prompt (batch
   ``--batch``) through ``init_inference(model, dtype=torch.float)`` and through the same model called directly;
   the two share the weights (the engine wraps a deep copy). Each repetition times one call of each, in
   alternating order; tokens/s = batch x new tokens / time. Reported: median tokens/s and engine / plain as the
   paired median (per-repetition ratios), target >= 0.95. The int8 engine (weight-only, ``q_groups`` = rows of
   the smallest Linear) is timed in the same loop, with its tiled int8 matmul (``quantized_matmul``) and with
   the plain reference path (whole weight dequantized each call), the speed-up as their paired median.
2. Latency at tp 2. Two gloo ranks, each builds the same model and ``init_inference(tensor_parallel={"tp_size":
   2})``; median ms of one forward over the prompt (prefill) and of one greedy generate, slowest rank, after a
   barrier; against the same numbers of the tp 1 engine measured in this process before the ranks start.
3. Memory, by accounting (bytes of the parameters and buffers the module holds; a tied tensor counts once): the
   fp32 model, the bf16 engine, the int8 engine (Linear and embedding weights int8, the tied lm_head sharing
   the embedding's codes); ratios against fp32.

Run: ``python benchmarks/inference.py`` (``--quick`` for a short run).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import logging
import os
import statistics
import time

import torch
import torch.distributed as dist
from _common import cpu_model, int_options, paired, spawn_ranks

from ds_inference import init_inference
from ds_inference.quantization import model_bytes


def build(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.prompt + args.new + 8, n_embd=args.hidden,
                     n_layer=args.layers, n_head=args.heads, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return GPT2LMHeadModel(cfg).eval()


def prompt(args: argparse.Namespace) -> torch.Tensor:
    return torch.randint(2, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def generate_fn(model, ids: torch.Tensor, new: int):
    mask = torch.ones_like(ids)
    return lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False)


def overhead(args: argparse.Namespace, model: torch.nn.Module) -> dict[str, list[float]]:
    ids = prompt(args)
    engine = init_inference(copy.deepcopy(model), dtype=torch.float, max_tokens=args.prompt + args.new)
    groups = args.hidden  # one scale per row of the smallest Linear: q_groups must divide every weight
    int8 = init_inference(copy.deepcopy(model), dtype=torch.int8, quant={"weight": {"q_groups": groups}})
    int8_ref = init_inference(copy.deepcopy(model), dtype=torch.int8, quant={"weight": {"q_groups": groups}})
    for module in int8_ref.module.modules():  # the plain reference path: whole weight dequantized per call
        if hasattr(module, "_tiled_matmul"):
            module._tiled_matmul = False
    runs = {"plain": generate_fn(model, ids, args.new), "engine": generate_fn(engine, ids, args.new),
            "int8": generate_fn(int8, ids, args.new), "int8_ref": generate_fn(int8_ref, ids, args.new)}
    same_int8 = torch.equal(runs["int8"](), runs["int8_ref"]())
    same = torch.equal(runs["plain"](), runs["engine"]())
    times: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(args.reps):
        order = list(runs) if rep % 2 == 0 else list(reversed(runs))
        for name in order:
            times[name].append(timed(runs[name]))
    times["same_tokens"], times["same_int8_tokens"] = [float(same)], [float(same_int8)]
    return times


@torch.no_grad()
def latency(args: argparse.Namespace, engine) -> tuple[float, float]:
    ids = prompt(args)
    forward = lambda: engine(input_ids=ids)  # noqa: E731
    gen = generate_fn(engine, ids, args.new)
    forward(), gen()  # warm-up
    fwd, gens = [], []
    for _ in range(args.reps):
        if dist.is_initialized():
            dist.barrier()
        fwd.append(timed(forward))
        gens.append(timed(gen))
    if dist.is_initialized():  # the slowest rank's time
        t = torch.tensor([statistics.median(fwd), statistics.median(gens)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0]), float(t[1])
    return statistics.median(fwd), statistics.median(gens)


def tp_rank(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        engine = init_inference(build(args), dtype=torch.float, tensor_parallel={"tp_size": 2})
        result = latency(args, engine)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = int_options(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), hidden=256, layers=4,
                         heads=8, vocab=4096, batch=2, prompt=32, new=32, reps=9)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and tokens")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.new = 3, 8
    torch.set_num_threads(1)
    model = build(args)
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, 1 thread per process")
    print(f"# GPT-2 hidden {args.hidden}, layers {args.layers}, heads {args.heads}, vocab {args.vocab}; batch "
          f"{args.batch}, prompt {args.prompt}, new tokens {args.new}, {args.reps} repetitions")

    times = overhead(args, model)
    tokens = args.batch * args.new
    print("\n## 1. generate throughput at tp 1 (fp32)")
    print(f"{'variant':<22}{'tokens/s':>10}{'vs plain (paired)':>20}")
    labels = {"plain": "plain HF model", "engine": "init_inference fp32", "int8": "init_inference int8",
              "int8_ref": "int8 reference path"}
    for name, label in labels.items():
        rate = tokens / statistics.median(times[name])
        ratio = paired(times["plain"], times[name])  # plain time / variant time = variant tokens/s / plain
        print(f"{label:<22}{rate:>10.1f}{ratio:>20.3f}")
    print(f"engine tokens equal plain tokens: {bool(times['same_tokens'][0])}; engine overhead "
          f"{(1 / paired(times['plain'], times['engine']) - 1) * 100:+.1f}% (target <= 5%)")
    print(f"int8 tiled / int8 reference (paired): {paired(times['int8_ref'], times['int8']):.3f}; same tokens: "
          f"{bool(times['same_int8_tokens'][0])}")

    one = latency(args, init_inference(copy.deepcopy(model), dtype=torch.float))
    two = spawn_ranks(tp_rank, args, world_size=2)
    print("\n## 2. latency, tp 1 vs tp 2 (gloo, 1 thread per rank)")
    print(f"{'':<26}{'tp 1 ms':>10}{'tp 2 ms':>10}{'tp2 / tp1':>11}")
    for i, label in enumerate(("forward (prefill)", f"generate {args.new} tokens")):
        print(f"{label:<26}{one[i] * 1e3:>10.1f}{two[i] * 1e3:>10.1f}{two[i] / one[i]:>11.2f}")

    print("\n## 3. memory by accounting (parameters + buffers held)")
    fp32 = model_bytes(model)
    kinds = ("Conv1D", "Linear", "Embedding")  # GPT-2's lm_head is tied to wte: counted once
    weights = {id(m.weight): m.weight.numel() * 4 for m in model.modules() if type(m).__name__ in kinds}
    print(f"{'model':<34}{'MiB':>9}{'vs fp32':>9}")
    for label, dtype in (("fp32 (plain)", None), ("bf16 engine", torch.bfloat16), ("int8 engine", torch.int8)):
        size = fp32 if dtype is None else model_bytes(init_inference(copy.deepcopy(model), dtype=dtype).module)
        print(f"{label:<34}{size / 2**20:>9.2f}{size / fp32:>9.3f}")
    int8 = init_inference(copy.deepcopy(model), dtype=torch.int8).module
    held = sum(b.numel() * b.element_size() for n, b in int8.named_buffers()
               if n.endswith(("weight_q", "weight_scale")))
    print(f"{'int8 weights + scales only':<34}{held / 2**20:>9.2f}{held / sum(weights.values()):>9.3f}"
          "  (vs their fp32 bytes)")
    print(f"(Linear and embedding weights are {sum(weights.values()) / fp32:.1%} of the fp32 bytes; biases and "
          "norms stay fp32)")

if __name__ == "__main__":
    main()
