"""Tokens routed to each expert: the histogram AutoEP's router returns and its all-to-all splits are built from."""

from __future__ import annotations

import torch


def count_tokens_per_expert(selected_experts_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``int32`` ``[num_experts]`` counts of the expert ids in ``selected_experts_indices`` (any shape).

    A scatter-add into a buffer of known size: unlike ``torch.bincount`` it needs no device-to-host read of the
    largest id to size the result."""
    flat = selected_experts_indices.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    return counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
