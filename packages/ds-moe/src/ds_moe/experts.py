"""``Experts``: the experts this rank holds, as independent deep copies of one expert module."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert`` under ``deepspeed_experts`` (DeepSpeed's state-dict names).

    Every expert parameter gets DeepSpeed's markers: ``allreduce = False`` (its gradient is not averaged over
    the data-parallel group) and ``group_name = expert_group_name`` (it is averaged over that expert group's
    expert-data-parallel group instead).
    """

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for local_expert in self.deepspeed_experts:
            for param in local_expert.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs: Tensor) -> Tensor:
        """``inputs`` ``[G, num_local_experts, C, M]`` (G = source ranks): local expert i takes ``[:, i:i+1]``.

        A tuple output (e.g. a Megatron ``(output, bias)``) contributes its first element.
        """
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        outputs = []
        for chunk, local_expert in zip(chunks, self.deepspeed_experts, strict=True):
            out = local_expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)
