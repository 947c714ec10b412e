"""Models, data and a one-process reference for the pipeline engine tests and benchmarks.

``mlp_specs`` (8 layers: Linear/Tanh) and ``gpt_specs`` (a tiny GPT: tied token embedding and LM head, causal
attention blocks) are ``PipelineModule`` layer lists. ``reference_losses`` trains the same layers as one model in
one process (every data-parallel shard's micro-batches, loss / (gas * dp), clipping, torch's Adam), which is what
the pipeline must reproduce.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from ds_pipe import LayerSpec, TiedLayerSpec

DIM, VOCAB, SEQ = 16, 32, 8


class Block(nn.Module):
    """A pre-norm causal self-attention + MLP block."""

    def __init__(self, dim: int = DIM, heads: int = 2) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    """Token + learned position embedding; its ``tok.weight`` is tied to the LM head."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, seq: int = SEQ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos[: ids.shape[1]]


def lm_head(embed: Embed, h: torch.Tensor) -> torch.Tensor:
    return h @ embed.tok.weight.t()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def mlp_specs(n: int = 8, dim: int = 8) -> list[Any]:
    return [LayerSpec(nn.Linear, dim, dim) if i % 2 == 0 else LayerSpec(nn.Tanh) for i in range(n)]


def gpt_specs(blocks: int = 4) -> list[Any]:
    return [TiedLayerSpec("embed", Embed, tied_weight_attr="tok.weight"),
            *[LayerSpec(Block) for _ in range(blocks)], LayerSpec(nn.LayerNorm, DIM),
            TiedLayerSpec("embed", Embed, forward_fn=lm_head, tied_weight_attr="tok.weight")]


def build_reference(specs: list[Any], base_seed: int = 1234) -> tuple[nn.Module, list[Any]]:
    """The layers as ``PipelineModule(seed_layers=True)`` builds them, as one model: (module holder, functions)."""
    holder, funcs, tied = nn.ModuleList(), [], {}
    for idx, spec in enumerate(specs):
        torch.manual_seed(base_seed + idx)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
                holder.append(tied[spec.key])
            module = tied[spec.key]
            funcs.append(module if spec.forward_fn is None else partial(spec.forward_fn, module))
        else:
            module = spec.build()
            holder.append(module)
            funcs.append(module)
    return holder, funcs


def mlp_batches(count: int, micro: int = 4, dim: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(micro, dim, generator=g), torch.randn(micro, dim, generator=g)) for _ in range(count)]


def gpt_batches(count: int, micro: int = 2, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (micro, SEQ + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def shard(batches: list[Any], dp_rank: int, dp: int) -> list[Any]:
    """The micro-batches data-parallel rank ``dp_rank`` reads (round robin)."""
    return batches[dp_rank::dp]


def reference_losses(specs: list[Any], batches: list[Any], loss_fn: Any, steps: int, gas: int, dp: int,
                     lr: float = 1e-2, clip: float = 0.0) -> list[float]:
    """Per optimizer step, the mean micro-batch loss over every data-parallel shard (what ``train_batch`` returns)."""
    holder, funcs = build_reference(specs)
    opt = torch.optim.Adam(holder.parameters(), lr=lr)
    shards = [shard(batches, r, dp) for r in range(dp)]
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for r in range(dp):
            for x, y in shards[r][step * gas:(step + 1) * gas]:
                for f in funcs:
                    x = f(x)
                loss = loss_fn(x, y)
                (loss / (gas * dp)).backward()
                total += float(loss.detach()) / (gas * dp)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(holder.parameters(), clip)
        opt.step()
        losses.append(total)
    return losses
