"""Top-1, top-2 and top-k gating as DeepSpeed defines them, producing a sparse :class:`Routing`.

Formulas (DeepSpeed / GShard): gates = softmax(logits); capacity = ceil(S / E * capacity_factor * k) floored
at ``min_capacity``; aux loss = E * sum_e(mean_s(gates[:, e]) * mean_s(first_choice_mask[:, e])) (top-k
divides by k); ``exp_counts`` counts routed tokens per expert before dropping. With ``drop_tokens=False``
the capacity is the largest expert load, agreed across the expert-parallel group by an all-reduce MAX.
Only ``[S, E]`` masks are built here; the dense ``[S, E, C]`` view is left to the reference dispatch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ds_moe._noise import gumbel_rsample
from ds_moe._routing import Routing, capacity, one_hot_mask

DROP_POLICIES = ("probs", "position")


def agreed_max_load(exp_counts: Tensor, ep_group: dist.ProcessGroup | None) -> int:
    """The largest per-expert load, all-reduced with MAX over ``ep_group`` when it has several ranks."""
    new_capacity = exp_counts.max().clone()
    if ep_group is not None and dist.get_world_size(group=ep_group) > 1:
        dist.all_reduce(new_capacity, op=dist.ReduceOp.MAX, group=ep_group)
    return int(new_capacity.item())


def _check_min_capacity(num_tokens: int, min_capacity: int) -> None:
    if num_tokens < min_capacity:
        raise ValueError(f"No. of tokens ({num_tokens}) should be at least min_capacity ({min_capacity}): "
                         "set min_capacity lower or increase the batch size")


def _keep_within_capacity(mask: Tensor, cap: int, use_rts: bool) -> Tensor:
    """Top-1 dropping: per expert keep ``cap`` of its tokens, chosen at random (RTS) or the earliest."""
    if use_rts:  # Random Token Selection: the same uniform draw DeepSpeed makes, [S, E]
        scores = mask * torch.rand(mask.shape, device=mask.device)
        top_idx = torch.topk(scores, k=min(cap, mask.shape[0]), dim=0)[1]
        return mask * torch.zeros_like(mask).scatter_(0, top_idx, 1)
    return mask * (torch.cumsum(mask, dim=0) - 1 < cap)


def top1_routing(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor | None = None,
                 noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
                 ep_group: dist.ProcessGroup | None = None) -> Routing:
    """Top-1 gating (Switch): each token goes to its argmax expert, weighted by its (unnormalised) gate."""
    num_tokens, num_experts = logits.shape
    if noisy_gate_policy == "RSample":
        logits_w_noise = logits + gumbel_rsample(logits.shape, device=logits.device)
    gates = F.softmax(logits, dim=1)
    cap = capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    indices1 = torch.argmax(logits_w_noise if noisy_gate_policy == "RSample" else gates, dim=1)
    mask1 = one_hot_mask(indices1, num_experts)
    if used_token is not None:
        mask1 = mask1 * used_token.reshape(-1, 1).to(mask1.dtype)
    exp_counts = torch.sum(mask1, dim=0).detach()
    if not drop_tokens:
        cap = min(agreed_max_load(exp_counts, ep_group), num_tokens)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.sum(me * ce) * num_experts
    _check_min_capacity(num_tokens, min_capacity)
    mask1 = _keep_within_capacity(mask1, cap, use_rts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    return Routing(
        l_aux=l_aux, exp_counts=exp_counts, capacity=cap, num_experts=num_experts,
        experts=indices1.unsqueeze(0), locations=torch.sum(locations1 * mask1, dim=1).unsqueeze(0),
        weights=torch.sum(gates * mask1, dim=1).unsqueeze(0), kept=(mask1.sum(dim=1) > 0).unsqueeze(0),
    )


def top2_routing(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
                 ep_group: dist.ProcessGroup | None = None, top2_2nd_expert_sampling: bool = True) -> Routing:
    """Top-2 gating (GShard): the argmax expert plus a second one (Gumbel-sampled by default), the two
    weights renormalised over the kept choices; first choices fill the buffers before second choices."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    indices1 = torch.argmax(gates, dim=1)
    mask1 = one_hot_mask(indices1, num_experts)
    if top2_2nd_expert_sampling:
        logits = logits + gumbel_rsample(logits.shape, device=logits.device)
    indices2 = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = one_hot_mask(indices2, num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (locations1 < cap)
        mask2 = mask2 * (locations2 < cap)
    else:
        cap = agreed_max_load(exp_counts, ep_group)
    gates1 = torch.sum(gates * mask1, dim=1)
    gates2 = torch.sum(gates * mask2, dim=1)
    denom = torch.clamp(gates1 + gates2, min=torch.finfo(gates.dtype).eps)
    return Routing(
        l_aux=l_aux, exp_counts=exp_counts, capacity=cap, num_experts=num_experts,
        experts=torch.stack([indices1, indices2]),
        locations=torch.stack([torch.sum(locations1 * mask1, dim=1), torch.sum(locations2 * mask2, dim=1)]),
        weights=torch.stack([gates1 / denom, gates2 / denom]),
        kept=torch.stack([mask1.sum(dim=1) > 0, mask2.sum(dim=1) > 0]),
    )


def topk_routing(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
                 ep_group: dist.ProcessGroup | None = None, drop_policy: str = "probs") -> Routing:
    """Top-k gating: the k most probable experts, weights renormalised over the kept ones. When a buffer
    overflows, ``drop_policy="probs"`` keeps its most probable tokens, ``"position"`` the earliest."""
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"Invalid drop_policy: {drop_policy!r}; accepted values are {DROP_POLICIES}")
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = torch.sum(mask, dim=0).detach()
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k
    if not drop_tokens:
        cap = agreed_max_load(exp_counts, ep_group)
    elif drop_policy == "probs":
        cap = capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        masked_gates = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
        _, cap_idx = torch.topk(masked_gates, k=min(cap, num_tokens), dim=0, sorted=False)
        mask = mask & torch.zeros_like(mask).scatter_(0, cap_idx, True)
    else:
        cap = capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        mask = mask & (torch.cumsum(mask, dim=0) - 1 < cap)
    locations = (torch.cumsum(mask, dim=0) - 1) * mask
    gates_masked = gates * mask
    gates_masked = gates_masked / torch.clamp(gates_masked.sum(dim=-1, keepdim=True),
                                              min=torch.finfo(gates.dtype).eps)
    return Routing(
        l_aux=l_aux, exp_counts=exp_counts, capacity=cap, num_experts=num_experts, experts=top_idx.t(),
        locations=locations.gather(1, top_idx).t(), weights=gates_masked.gather(1, top_idx).t(),
        kept=mask.gather(1, top_idx).t(),
    )
