"""The gate's routing decision in sparse form, and DeepSpeed's dense ``[tokens, experts, capacity]`` view of it.

Every gating function computes a :class:`Routing`: for each of the ``k`` choices of each of the ``S`` tokens,
the expert it goes to, its slot in that expert's capacity buffer, its combine weight and whether it was kept
(not dropped). The optimized dispatch uses it as is; :func:`dense_combine_weights` builds DeepSpeed's one-hot
``combine_weights`` / ``dispatch_mask`` from it for the plain einsum reference path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class Routing:
    """Where each token choice goes. Shapes: ``[k, S]`` for the per-choice tensors."""

    l_aux: Tensor  # scalar load-balancing loss (fp32, differentiable w.r.t. the gate logits)
    exp_counts: Tensor  # [E] int64: tokens routed to each expert before capacity dropping
    capacity: int  # slots per expert
    num_experts: int
    experts: Tensor  # [k, S] int64 expert id of each choice
    locations: Tensor  # [k, S] int64 slot inside the expert's buffer (0 where dropped)
    weights: Tensor  # [k, S] fp32 combine weight (0 where dropped; differentiable)
    kept: Tensor  # [k, S] bool: the choice holds a slot

    def slots(self) -> Tensor:
        """``[k, S]`` row index of each choice in the flattened ``[E * capacity]`` buffer."""
        return self.experts * self.capacity + self.locations


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """``ceil(tokens / experts * capacity_factor)``, floored at ``min_capacity``.

    Computed as DeepSpeed does (the factor as a 0-dim tensor of the default dtype) so rounding agrees.
    """
    value = int(torch.ceil((num_tokens / num_experts) * torch.tensor(capacity_factor)).item())
    return max(value, int(min_capacity))


def one_hot_mask(indices: Tensor, num_experts: int) -> Tensor:
    """``[S] -> [S, E]`` int64 one-hot."""
    return F.one_hot(indices, num_classes=num_experts)


def dense_combine_weights(routing: Routing) -> tuple[Tensor, Tensor]:
    """DeepSpeed's ``combine_weights`` ``[S, E, C]`` (fp32) and ``dispatch_mask`` (bool) from a routing.

    Built as DeepSpeed does: per choice, ``einsum("se,sc->sec", weight * expert_one_hot, slot_one_hot)``.
    """
    combine = None
    for j in range(routing.experts.shape[0]):
        weight = (routing.weights[j] * routing.kept[j]).unsqueeze(1)
        gates_se = F.one_hot(routing.experts[j], num_classes=routing.num_experts).to(weight.dtype) * weight
        locations_sc = F.one_hot(routing.locations[j], num_classes=routing.capacity).to(weight.dtype)
        term = torch.einsum("se,sc->sec", gates_se, locations_sc)
        combine = term if combine is None else combine + term
    return combine, combine.bool()
