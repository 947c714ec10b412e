"""Moving tokens into the ``[E, C, M]`` expert buffers and their outputs back: two interchangeable ways.

``einsum``: DeepSpeed's reference. ``dispatch_mask`` / ``combine_weights`` are dense ``[S, E, C]`` one-hots
and both moves are einsums (``sec,sm->ecm`` and ``sec,ecm->sm``): O(S * E * C) memory and flops.
``indexed`` (default): the routing's slot index per token choice; dispatch copies each kept token into its
slot, combine gathers each choice's slot and weights it: O(k * S * M), no ``[S, E, C]`` tensor at all.
Both fill the same buffer layout, so the all-to-all and the experts see identical inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ds_moe._routing import Routing, dense_combine_weights

DISPATCH_MODES = ("indexed", "einsum")


def check_dispatch_mode(mode: str) -> str:
    if mode not in DISPATCH_MODES:
        raise ValueError(f"Unknown MoE dispatch mode {mode!r}; accepted values are {DISPATCH_MODES}")
    return mode


def dispatch_einsum(tokens: Tensor, dispatch_mask: Tensor) -> Tensor:
    """``[S, M]`` tokens -> ``[E, C, M]`` buffers through the dense ``[S, E, C]`` mask."""
    return torch.einsum("sec,sm->ecm", dispatch_mask.type_as(tokens), tokens)


def combine_einsum(expert_output: Tensor, combine_weights: Tensor) -> Tensor:
    """``[E, C, M]`` expert outputs -> ``[S, M]`` through the dense ``[S, E, C]`` combine weights."""
    return torch.einsum("sec,ecm->sm", combine_weights.type_as(expert_output), expert_output)


def _kept_choices(routing: Routing) -> tuple[Tensor, Tensor]:
    """(buffer row, token index) of every kept choice, choice-major."""
    k, num_tokens = routing.experts.shape
    kept = routing.kept.reshape(-1)
    token_of = torch.arange(num_tokens, device=kept.device).repeat(k)
    return routing.slots().reshape(-1)[kept], token_of[kept]


def dispatch_indexed(tokens: Tensor, routing: Routing) -> Tensor:
    """``[S, M]`` tokens -> ``[E, C, M]`` buffers by copying each kept choice into its (unique) slot."""
    rows, token_ids = _kept_choices(routing)
    buffer = tokens.new_zeros(routing.num_experts * routing.capacity, tokens.shape[1])
    buffer = buffer.index_copy(0, rows, tokens.index_select(0, token_ids))
    return buffer.view(routing.num_experts, routing.capacity, tokens.shape[1])


def combine_indexed(expert_output: Tensor, routing: Routing) -> Tensor:
    """``[E, C, M]`` expert outputs -> ``[S, M]``: sum over choices of weight * the choice's slot."""
    flat = expert_output.reshape(-1, expert_output.shape[-1])
    slots = routing.slots()
    weights = (routing.weights * routing.kept).to(expert_output.dtype)
    out = flat.index_select(0, slots[0]) * weights[0].unsqueeze(1)
    for j in range(1, slots.shape[0]):
        out = out + flat.index_select(0, slots[j]) * weights[j].unsqueeze(1)
    return out


# ---- DeepSpeed's route format: (expert or -1, location, gate) per route, each [k, S] -------------------------
def sparse_routes(routing: Routing) -> tuple[Tensor, Tensor, Tensor]:
    """The routing as DeepSpeed's gates return it with ``sparse_routes=True``: int32 expert ids with -1 for a
    route the capacity dropped, int32 locations (0 where dropped) and the fp32 gate weights (0 where dropped)."""
    experts = torch.where(routing.kept, routing.experts, torch.full_like(routing.experts, -1))
    return experts.to(torch.int32), (routing.locations * routing.kept).to(torch.int32), routing.weights


def route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """``[k, S]`` flat slot of each route in the ``[E * C]`` buffer; a dropped route (expert ``< 0``) gets the
    extra slot ``E * C`` past the end, which :func:`sparse_encode` and :func:`sparse_decode` treat as empty."""
    slot = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, slot, torch.full_like(slot, num_experts * capacity))


def sparse_encode(tokens: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """``[S, M]`` tokens -> ``[E, C, M]`` buffers from :func:`route_slots`: every slot reads the token routed to
    it (slots no route fills read zeros). One gather over the buffer: kept routes never share a slot."""
    num_tokens, d_model = tokens.shape
    rows = num_experts * capacity
    token_of_slot = torch.full((rows + 1, ), num_tokens, dtype=torch.long, device=tokens.device)
    route_tokens = torch.arange(num_tokens, device=tokens.device).expand_as(slots)
    token_of_slot.scatter_(0, slots.reshape(-1), route_tokens.reshape(-1))
    with_zero_row = torch.cat([tokens, tokens.new_zeros(1, d_model)])
    return with_zero_row.index_select(0, token_of_slot[:rows]).view(num_experts, capacity, d_model)


def sparse_decode(expert_output: Tensor, slots: Tensor, gates: Tensor, num_tokens: int) -> Tensor:
    """``[E * C, M]`` expert outputs -> ``[S, M]``: each token's routes weighted by their gates and summed. The
    product and the sum run in the gates' fp32 (as DeepSpeed's dense einsum accumulated), then cast back."""
    d_model = expert_output.shape[-1]
    with_zero_row = torch.cat([expert_output, expert_output.new_zeros(1, d_model)])
    routed = with_zero_row.index_select(0, slots.reshape(-1)).view(slots.shape[0], num_tokens, d_model)
    return (routed * gates.unsqueeze(-1)).sum(0).to(expert_output.dtype)


def dispatch(tokens: Tensor, routing: Routing, mode: str) -> tuple[Tensor, Tensor | None]:
    """Buffers for ``routing`` with ``mode``; also the dense combine weights when ``mode`` is einsum."""
    if mode == "einsum":
        combine_weights, dispatch_mask = dense_combine_weights(routing)
        return dispatch_einsum(tokens, dispatch_mask), combine_weights
    return dispatch_indexed(tokens, routing), None


def combine(expert_output: Tensor, routing: Routing, combine_weights: Tensor | None) -> Tensor:
    """Outputs back to tokens: einsum when dense combine weights are given, indexed otherwise."""
    if combine_weights is not None:
        return combine_einsum(expert_output, combine_weights)
    return combine_indexed(expert_output, routing)
