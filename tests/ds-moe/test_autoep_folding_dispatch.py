"""AutoEP+AutoTP folding's routed-assignment split on 2 real gloo ranks (one tensor-parallel group): the restored
output equals the unpartitioned combine bitwise on every peer, its gradients summed over the peers equal the
unpartitioned combine's gradients of the summed losses, and diverging routing is caught."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _harness import run_distributed

from ds_moe.autoep import combine_from_routed
from ds_moe.ep_tp_dispatch import (
    RoutedAssignmentPayload,
    assert_tp_payload_consistent,
    assignment_ordinals_by_expert,
    partition_assignments,
    restore_combined,
)

TOKENS, TOP_K, EXPERTS, HIDDEN = 7, 2, 4, 3


def _routed(expert_shift: int = 0):
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(TOKENS, TOP_K, generator=g)
    choice = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    choice = (choice + expert_shift) % EXPERTS
    order = torch.argsort(choice.reshape(-1), stable=True)
    experts = choice.reshape(-1)[order]
    zeros = torch.zeros(order.numel(), dtype=torch.bool)
    splits = torch.bincount(experts // 2, minlength=2).tolist()
    payload = RoutedAssignmentPayload(
        token_indices=order // TOP_K, expert_indices=experts, assignment_indices=assignment_ordinals_by_expert(experts),
        capacity_slots=order % TOP_K, combine_weights=scores.reshape(-1)[order], drop_mask=zeros,
        pad_mask=zeros.clone(), input_splits=splits, output_splits=list(splits),
        extra={"destination_ranks": experts // 2, "num_tokens": TOKENS})
    outputs = torch.randn(order.numel(), HIDDEN, generator=g)
    return payload, scores, order, outputs


def _restore_body():
    rank, world = dist.get_rank(), dist.get_world_size()
    payload, scores, order, outputs = _routed()
    # reference: the unpartitioned combine, every peer's loss (weighted by rank + 1) summed
    ref_out = outputs.clone().requires_grad_(True)
    ref_scores = scores.clone().requires_grad_(True)
    want = combine_from_routed(ref_out, ref_scores, order, TOP_K, "post", "weighted_sum", (1, TOKENS, HIDDEN))
    sum((want * (r + 1)).square().sum() for r in range(world)).backward()

    out = outputs.clone().requires_grad_(True)
    top = scores.clone().requires_grad_(True)
    payload.combine_weights = top.reshape(-1).index_select(0, order)
    _, ctx = partition_assignments(payload, tp_group=dist.group.WORLD, tp_rank=rank, tp_size=world)
    got = restore_combined(out.index_select(0, ctx.local_indices), ctx, tp_group=dist.group.WORLD,
                           validate_coverage=True)
    same = torch.equal(got.reshape(want.shape), want.detach())
    (got * (rank + 1)).square().sum().backward()
    grads = [out.grad.clone(), top.grad.clone()]
    for grad in grads:
        dist.all_reduce(grad)
    return same, torch.allclose(grads[0], ref_out.grad, atol=1e-5), torch.allclose(grads[1], ref_scores.grad,
                                                                                   atol=1e-5)


def test_restore_over_two_peers_matches_the_unpartitioned_combine():
    assert run_distributed(_restore_body, world_size=2, timeout=60) == [(True, True, True)] * 2


def _consistency_body(diverge: bool):
    payload = _routed(expert_shift=1 if diverge and dist.get_rank() == 1 else 0)[0]
    try:
        assert_tp_payload_consistent(payload, tp_group=dist.group.WORLD, tp_size=2)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_diverging_routing_is_caught_on_every_peer():
    assert run_distributed(_consistency_body, world_size=2, args=(False,), timeout=60) == [None, None]
    messages = run_distributed(_consistency_body, world_size=2, args=(True,), timeout=60)
    assert all(m is not None and "routing decisions differ" in m and "expert_indices" in m for m in messages)
