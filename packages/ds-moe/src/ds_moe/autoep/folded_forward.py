"""The folded expert step of an ``AutoEPMoELayer`` bound to AutoEP+AutoTP folding handles
(``ds_moe.autoep.folded``): this TP peer's share of the routed assignments goes through the expert all-to-all,
and the peers' outputs are gathered back and combined (``ds_moe.ep_tp_dispatch``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ds_moe.ep_tp_dispatch import (
    RoutedAssignmentPayload,
    assert_tp_payload_consistent,
    assignment_ordinals_by_expert,
    partition_assignments,
    restore_combined,
)


def folded_expert_combine(layer: Any, routed_input: Tensor, router: Any, order: Tensor, scores_sorted: Tensor) -> \
        Tensor:
    """``[tokens, hidden]``: the layer's routed experts on this TP peer's share of the assignments, gathered and
    combined over the TP group. ``routed_input``: the rows of the flat top-k choices in expert order (``order``);
    ``layer``: an ``AutoEPMoELayer`` bound to folding handles."""
    handles = layer.folding_group_handles
    tp_group, tp_size = handles.tp_group, handles.spec.tp_size
    top_k = layer.top_k
    expert_ids = router.selected_experts.reshape(-1).index_select(0, order)
    destinations = torch.div(expert_ids, layer.num_local_experts, rounding_mode="floor")
    splits = torch.bincount(destinations, minlength=layer.ep_size).tolist()
    no_rows = torch.zeros_like(expert_ids, dtype=torch.bool)
    weights = scores_sorted if layer.score_apply == "post" else torch.ones_like(scores_sorted)
    payload = RoutedAssignmentPayload(
        token_indices=torch.div(order, top_k, rounding_mode="floor"), expert_indices=expert_ids,
        assignment_indices=assignment_ordinals_by_expert(expert_ids), capacity_slots=order.remainder(top_k),
        combine_weights=weights, drop_mask=no_rows, pad_mask=no_rows.clone(), input_splits=splits,
        output_splits=list(splits),
        extra={"destination_ranks": destinations, "num_tokens": order.numel() // top_k})
    if layer.validate_folding_routing:
        assert_tp_payload_consistent(payload, tp_group=tp_group, tp_size=tp_size)
    local, ctx = partition_assignments(payload, tp_group=tp_group, tp_rank=dist.get_rank(group=tp_group),
                                       tp_size=tp_size)
    counts = torch.bincount(local.expert_indices, minlength=layer.num_experts)
    local_output = layer._dispatch(routed_input.index_select(0, ctx.local_indices),
                                   router._replace(num_tokens_per_expert=counts), local.expert_indices)
    return restore_combined(local_output, ctx, tp_group=tp_group)
