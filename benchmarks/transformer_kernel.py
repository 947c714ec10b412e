"""The transformer kernel layer (``deepspeed.ops.transformer.DeepSpeedTransformerLayer``) against Hugging Face's
``BertLayer`` on the same weights, and what its memory options save.

Layer: BERT-base (``--hidden`` 768, ``--heads`` 12, intermediate 4 x hidden), Post-LN, dropout 0.1 on the attention
probabilities and the hidden states (BERT's), training mode, fp32, ``--batch`` x ``--seq`` tokens. One iteration =
forward of a fresh input requiring grad plus backward of ``output.square().mean()``; gradients set to None before.

1. Time: median ms over ``--reps`` repetitions, each timing one iteration of every variant in rotating order
   (drifting load hits all alike). Baseline: ``BertLayer`` with ``attn_implementation="sdpa"`` and with ``"eager"``.
   Ratio: the layer's median / the sdpa baseline's.
2. Memory, by accounting: bytes of the distinct storages autograd keeps for backward (``saved_tensors_hooks``),
   beyond the parameters, the input and the output (alive anyway), for the layer without memory options, with each
   of ``gelu_checkpoint``, ``attn_dropout_checkpoint``, ``normalize_invertible``, and all three; and the same count
   for ``BertLayer``. Saving = 1 - bytes / the layer's bytes without options. Outputs and gradients of every
   variant are checked against the layer without options (same dropout masks: each iteration starts from the
   same torch seed).

Run: ``python benchmarks/transformer_kernel.py`` (``--quick`` for a short run).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch
from _common import int_options
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertLayer

from ds_ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer

OPTIONS = ("gelu_checkpoint", "attn_dropout_checkpoint", "normalize_invertible")


def _bert(args: argparse.Namespace, attn: str) -> BertLayer:
    config = BertConfig(hidden_size=args.hidden, num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, attn_implementation=attn)
    torch.manual_seed(0)
    return BertLayer(config).train()


def _ds(args: argparse.Namespace, ref: BertLayer, **options: bool) -> DeepSpeedTransformerLayer:
    attn = ref.attention
    modules = [attn.self.query, attn.self.key, attn.self.value, attn.output.dense, attn.output.LayerNorm,
               ref.intermediate.dense, ref.output.dense, ref.output.LayerNorm]
    config = DeepSpeedTransformerConfig(batch_size=args.batch, hidden_size=args.hidden, heads=args.heads,
                                        attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1, num_hidden_layers=12,
                                        initializer_range=0.02, pre_layer_norm=False, **options)
    return DeepSpeedTransformerLayer(config, [m.weight for m in modules], [m.bias for m in modules])


def _iteration(layer: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, count: bool = False):
    """One forward + backward; returns (output, input grad, saved activation bytes or None)."""
    for p in layer.parameters():
        p.grad = None
    x = x.detach().requires_grad_()
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if count:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(x, mask)
    else:
        out = layer(x, mask)
    out = out[0] if isinstance(out, tuple) else out
    alive = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    alive |= {x.untyped_storage().data_ptr(), out.untyped_storage().data_ptr()}
    out.square().mean().backward()
    return out.detach(), x.grad, (sum(n for k, n in saved.items() if k not in alive) if count else None)


def main() -> None:
    parser = int_options(argparse.ArgumentParser(description=__doc__.splitlines()[0]), hidden=768, heads=12,
                         batch=8, seq=128, reps=7)
    parser.add_argument("--quick", action="store_true", help="hidden 256, seq 64, 3 repetitions")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.heads, args.seq, args.reps = 256, 4, 64, 3
    print(f"# transformer kernel layer | {datetime.date.today()} | torch {torch.__version__} | "
          f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads")
    print(f"# hidden {args.hidden}, heads {args.heads}, batch {args.batch}, seq {args.seq}, fp32, training, "
          "dropout 0.1")
    x = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(args.batch, 1, 1, args.seq)
    mask[::2, ..., -args.seq // 4:] = -10000.0  # padding in every other sequence
    sdpa_ref, eager_ref = _bert(args, "sdpa"), _bert(args, "eager")
    variants = {"BertLayer (sdpa)": sdpa_ref, "BertLayer (eager)": eager_ref, "ds layer": _ds(args, sdpa_ref)}
    for option in OPTIONS:
        variants[f"ds + {option}"] = _ds(args, sdpa_ref, **{option: True})
    variants["ds + all three"] = _ds(args, sdpa_ref, **dict.fromkeys(OPTIONS, True))

    accounts, reference = {}, None
    for name, layer in variants.items():
        torch.manual_seed(5)
        out, grad, nbytes = _iteration(layer, x, mask, count=True)
        accounts[name] = nbytes
        if name.startswith("ds"):
            reference = reference or (out, grad)
            diff = max((out - reference[0]).abs().max().item(), (grad - reference[1]).abs().max().item())
            assert diff < 1e-4, f"{name} differs from the layer without options by {diff}"
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            start = time.perf_counter()
            _iteration(variants[name], x, mask)
            times[name].append((time.perf_counter() - start) * 1e3)
    base_ms, base_bytes = statistics.median(times["BertLayer (sdpa)"]), accounts["ds layer"]
    print(f"{'variant':<34}{'fwd+bwd ms':>12}{'vs sdpa':>9}{'saved MiB':>11}{'saving':>9}")
    for name in names:
        ms, nbytes = statistics.median(times[name]), accounts[name]
        print(f"{name:<34}{ms:>12.1f}{ms / base_ms:>9.2f}{nbytes / 2**20:>11.2f}{1 - nbytes / base_bytes:>9.1%}")


if __name__ == "__main__":
    main()
