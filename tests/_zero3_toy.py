"""Shared by the ZeRO-3 checkpoint / ZeRO-Infinity tests: a small model with a frozen layer and a tied weight,
and one data-parallel training step on a fixed global batch (rank r takes its slice) returning the global loss."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

GLOBAL = 8  # samples per global batch
IN, OUT = 6, 3  # model input / output features
# stage 3 with small buckets and sub-groups, so that a 12-wide model has persistent and partitioned parameters,
# several sub-groups and several buckets
INFINITY_ZERO = {"stage": 3, "stage3_param_persistence_threshold": 20, "reduce_bucket_size": 100,
                 "sub_group_size": 60, "stage3_prefetch_bucket_size": 100}


class TiedNet(torch.nn.Module):
    """A frozen layer, small (persistent) and large (partitioned) parameters, a tied weight; ``scale``: a
    buffer the output is multiplied by (none when ``None``), so that checkpoints carry a buffer too."""

    def __init__(self, hidden: int = 12, scale: float | None = None) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(IN, hidden)
        self.frozen = torch.nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        self.mid = torch.nn.Linear(hidden, hidden)
        self.back = torch.nn.Linear(hidden, hidden, bias=False)
        self.back.weight = self.mid.weight
        self.head = torch.nn.Linear(hidden, OUT)
        if scale is not None:
            self.register_buffer("scale", torch.tensor(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(torch.tanh(self.frozen(h))))
        out = self.head(torch.tanh(self.back(h)))
        return out * self.scale if hasattr(self, "scale") else out


def train_step(engine, step: int, after_backward: Callable[[], None] | None = None) -> float:
    """One step on global batch ``step`` (seeded, the same on every world size); ``after_backward`` runs
    between backward and step. Returns the loss averaged over the ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL, IN, generator=gen), torch.randn(GLOBAL, OUT, generator=gen)
    micro = GLOBAL // world
    loss = torch.nn.functional.mse_loss(engine(x[rank * micro:(rank + 1) * micro]), y[rank * micro:(rank + 1) * micro])
    engine.backward(loss)
    if after_backward is not None:
        after_backward()
    engine.step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t) / world
