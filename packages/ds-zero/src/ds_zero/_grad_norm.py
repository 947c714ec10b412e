"""The global L2 norm of gradients partitioned across a data-parallel group (ZeRO stages 1-3): each rank's
sum of squares, one scalar all-reduce, the square root. inf/nan on any rank makes it inf/nan on every rank."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


def partitioned_norm(grads: list[torch.Tensor], comm: Any, group: Any, world: int) -> float:
    device = grads[0].device if grads else torch.device("cpu")
    sumsq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        if g.numel():
            sumsq += torch.linalg.vector_norm(g, 2.0, dtype=torch.float32).to(device) ** 2
    if world > 1:
        if dist.get_backend(group) == "nccl" and sumsq.device.type == "cpu":
            sumsq = sumsq.cuda()
        comm.all_reduce(sumsq, group=group)
    return math.sqrt(float(sumsq))
