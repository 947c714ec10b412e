"""Profiling overhead of ds_profiler: a forward pass with the profiler on vs the same forward without it.

Models (issue 3): a tiny GPT-2 (``transformers.GPT2LMHeadModel``) and a tiny BERT (``transformers.BertModel``)
built from config objects with random weights (no download), both with eager attention so FlopCounterMode
can price every matmul, and a small CNN (tests/ds-profiler/tiny_models.py: conv-bn-relu-pool x2, linear).
Each at the size the tests use and at a realistic small input size; ``--large`` adds a GPT-2 with wider
layers. Forwards run under no_grad, plain and profiled interleaved (the machine may be shared: noise hits
both alike). "ratio" is min(profiled) / min(plain), "median" the median of the per-pair ratios, "floor" the
same ratio for a TorchDispatchMode that does nothing but run each op: the price torch itself charges for
intercepting every aten op in Python (about 5-10 us per op), which no dispatch-mode profiler can go below.
Also checks 2 x counted MACs against FlopCounterMode's FLOPs for the same forward.

Issue 3's target, under 1.5x on CPU, applies to the realistic rows: at the test sizes a forward is ~150
aten ops of a few microseconds each, so the ratio measures only the per-op interception cost (the floor
column), not the work a user profiles.

Run: python benchmarks/profiler.py [--repeats N] [--threads T] [--large]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import pathlib
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import ds_profiler  # noqa: E402
from ds_profiler import FlopsProfiler, number_to_string  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 1000


class NullMode(TorchDispatchMode):
    """Runs every op unchanged: the cost of the interception alone."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def small_cnn():
    path = ROOT / "tests" / "ds-profiler" / "tiny_models.py"
    spec = importlib.util.spec_from_file_location("tiny_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SmallCNN().eval()


def gpt2(dim: int, layers: int, heads: int):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=dim, n_layer=layers, n_head=heads,
                                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config).eval()


def bert(dim: int, layers: int, heads: int):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=dim, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=4 * dim,
                                     max_position_embeddings=128, attn_implementation="eager")
    return transformers.BertModel(config).eval()


def text(batch: int, seq: int) -> dict:
    ids = torch.randint(1, VOCAB, (batch, seq))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def cases(large: bool):
    """(size label, name, model, kwargs-or-tensor)."""
    torch.manual_seed(0)
    tiny_gpt2, tiny_bert, cnn = gpt2(64, 2, 4), bert(64, 2, 4), small_cnn()
    yield "test", "gpt2 d64 L2, b2 s16", tiny_gpt2, text(2, 16)
    yield "test", "bert d64 L2, b2 s16", tiny_bert, text(2, 16)
    yield "test", "cnn, 2x3x16x16", cnn, torch.randn(2, 3, 16, 16)
    yield "realistic", "gpt2 d64 L2, b4 s128", tiny_gpt2, text(4, 128)
    yield "realistic", "bert d64 L2, b4 s128", tiny_bert, text(4, 128)
    yield "realistic", "cnn, 16x3x64x64", cnn, torch.randn(16, 3, 64, 64)
    if large:
        yield "realistic", "gpt2 d256 L4, b4 s128", gpt2(256, 4, 8), text(4, 128)
        yield "realistic", "bert d256 L4, b4 s128", bert(256, 4, 8), text(4, 128)


def call(model, inputs) -> None:
    if isinstance(inputs, dict):
        model(**inputs)
    else:
        model(inputs)


def timed(model, inputs, mode=None) -> float:
    with torch.no_grad():
        start = time.perf_counter()
        if mode is None:
            call(model, inputs)
        else:
            with mode:
                call(model, inputs)
        return time.perf_counter() - start


def measure(model, inputs, repeats: int) -> dict:
    """Plain, null-mode and profiled forwards interleaved; the profiler is started before and stopped after
    each profiled forward, outside the timed region (start/stop cost is per profile, not per forward)."""
    prof = FlopsProfiler(model)
    plain, null, profiled = [], [], []
    for index in range(repeats + 3):  # the first 3 rounds warm up every path
        plain_s = timed(model, inputs)
        null_s = timed(model, inputs, NullMode())
        prof.start_profile()
        profiled_s = timed(model, inputs)
        prof.stop_profile()
        if index >= 3:
            plain.append(plain_s)
            null.append(null_s)
            profiled.append(profiled_s)
    macs, flops = prof.get_total_macs(), prof.get_total_flops()
    prof.end_profile()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        call(model, inputs)
    return {"plain": min(plain), "profiled": min(profiled), "floor": min(null) / min(plain),
            "median_ratio": statistics.median(p / q for p, q in zip(profiled, plain, strict=True)),
            "macs": macs, "flops": flops, "ref": counter.get_total_flops()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise)")
    parser.add_argument("--large", action="store_true", help="also GPT-2/BERT with d256, 4 layers")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    transformers.logging.set_verbosity_error()
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}  torch: {torch.__version__}  "
          f"transformers: {transformers.__version__}  cores: {os.cpu_count()}  torch threads: "
          f"{torch.get_num_threads()}  repeats: {opts.repeats}\nds_profiler: {ds_profiler.__file__}")
    header = (f"{'size':<9} {'model, input':<24} {'plain ms':>9} {'profiled ms':>12} {'ratio':>6} {'median':>7} "
              f"{'floor':>6}  {'MACs':>9} {'FLOPs':>9} {'2xMACs == FlopCounterMode':>26}")
    print(header)
    print("-" * len(header))
    for size, name, model, inputs in cases(opts.large):
        r = measure(model, inputs, opts.repeats)
        agree = "yes" if 2 * r["macs"] == r["ref"] else f"no ({number_to_string(r['ref'])})"
        print(f"{size:<9} {name:<24} {r['plain'] * 1e3:>9.3f} {r['profiled'] * 1e3:>12.3f} "
              f"{r['profiled'] / r['plain']:>5.2f}x {r['median_ratio']:>6.2f}x {r['floor']:>5.2f}x  "
              f"{number_to_string(r['macs']):>9} {number_to_string(r['flops']):>9} {agree:>26}")
    print("target (issue 3): ratio < 1.5x on CPU for the 'realistic' rows; 'floor' is torch's own interception "
          "cost, measured in the same run")


if __name__ == "__main__":
    main()
