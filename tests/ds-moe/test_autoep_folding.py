"""AutoEP folded onto AutoTP, single process: the layout tables, the refusals, the gradient families, the routed
assignment split and its restore (bitwise the unpartitioned combine)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_moe.autoep import AutoEPConfig, combine_from_routed, validate_autoep_config
from ds_moe.autoep.folding import (
    AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE,
    AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL,
    AUTOEP_FOLDING_GRAD_REDUCE_SKIP,
    AUTOEP_FOLDING_GRAD_REDUCE_SUM,
    assert_group_matches_spec,
    autoep_folding_gradient_reduction_strategy,
    build_folding_spec,
    expected_folding_group_tables,
    local_folding_ranks,
    mark_autoep_folding_partial_router_parameter,
)
from ds_moe.ep_tp_dispatch import (
    RoutedAssignmentPayload,
    assignment_ordinals_by_expert,
    dispatch_counters,
    partition_assignments,
    restore_combined,
)


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), ep=st.sampled_from([1, 2, 4, 8]), groups=st.integers(1, 4))
def test_every_rank_is_in_exactly_one_group_of_each_kind(tp, ep, groups):
    world = max(tp, ep) * groups
    if world % tp or world % ep:
        return
    spec = build_folding_spec(world_size=world, pp_size=1, tp_size=tp, ep_size=ep)
    tables = expected_folding_group_tables(spec)
    for table, size in ((tables.tp_groups, tp), (tables.dense_dp_groups, world // tp), (tables.ep_groups, ep),
                        (tables.edp_groups, world // ep)):
        assert sorted(r for g in table for r in g) == list(range(world))
        assert {len(g) for g in table} == {size}
    for rank in range(world):
        local = local_folding_ranks(rank, spec)
        assert set(local["tp"]) & set(local["dense_dp"]) == {rank}  # one rank per TP lane in the dense group
        assert set(local["ep"]) & set(local["edp"]) == {rank}


def test_tp2_ep4_on_8_ranks_keeps_expert_groups_consecutive():
    tables = expected_folding_group_tables(build_folding_spec(world_size=8, pp_size=1, tp_size=2, ep_size=4))
    assert tables.tp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert tables.dense_dp_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert tables.ep_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert tables.edp_groups == ((0, 4), (1, 5), (2, 6), (3, 7))


@pytest.mark.parametrize(("kwargs", "words"), [
    (dict(world_size=8, tp_size=3, ep_size=2), "Valid autotp_size values: [1, 2, 4, 8]"),
    (dict(world_size=8, tp_size=2, ep_size=3), "Valid expert-width values: [1, 2, 4, 8]"),
    (dict(world_size=8, tp_size=2, ep_size=1), "autoep_size > 1"),
    (dict(world_size=8, tp_size=2, ep_size=2, zero_stage=3), "ZeRO stage 3"),
    (dict(world_size=8, tp_size=2, ep_size=2, zero_offload_optimizer=True), "offload"),
    (dict(world_size=8, tp_size=2, ep_size=2, deepcompile_enabled=True), "DeepCompile"),
    (dict(world_size=8, tp_size=2, ep_size=2, sp_size=2), "mutually exclusive"),
    (dict(world_size=8, tp_size=2, ep_size=2, pp_size=2), "pp_size=1 only"),
    (dict(world_size=8, tp_size=2, ep_size=2, use_data_before_expert_parallel=True), "use_data_before"),
])
def test_folding_refusals_name_the_key(kwargs, words):
    kwargs = {"pp_size": 1, "sp_size": 1, **kwargs}
    ep = kwargs.pop("ep_size")
    with pytest.raises(ValueError) as err:
        validate_autoep_config(AutoEPConfig(enabled=True, autoep_size=ep), **kwargs)
    assert words in str(err.value)


def test_unfolded_autoep_keeps_pipelines_zero3_and_deepcompile():
    config = AutoEPConfig(enabled=True, autoep_size=2)
    validate_autoep_config(config, world_size=8, pp_size=2, tp_size=1, sp_size=1, zero_stage=3,
                           deepcompile_enabled=True)


def test_cached_groups_of_another_layout_are_refused():
    spec = build_folding_spec(world_size=8, pp_size=1, tp_size=2, ep_size=4)
    assert_group_matches_spec(([(0, 1, 2, 3)], [(1, 5)]), spec)
    with pytest.raises(RuntimeError, match="does not match folding spec"):
        assert_group_matches_spec(([(0, 2, 4, 6)], [(0, 1)]), spec)


def test_gradient_families():
    spec = build_folding_spec(world_size=4, pp_size=1, tp_size=2, ep_size=2)
    dense, expert, sharded, partial = (torch.nn.Parameter(torch.ones(1)) for _ in range(4))
    expert.allreduce = False
    sharded.tensor_model_parallel = True
    mark_autoep_folding_partial_router_parameter(partial)
    assert autoep_folding_gradient_reduction_strategy(spec, dense) == AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE
    assert autoep_folding_gradient_reduction_strategy(spec, expert) == AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL
    assert autoep_folding_gradient_reduction_strategy(spec, sharded) == AUTOEP_FOLDING_GRAD_REDUCE_SKIP
    assert autoep_folding_gradient_reduction_strategy(spec, partial) == AUTOEP_FOLDING_GRAD_REDUCE_SUM
    assert autoep_folding_gradient_reduction_strategy(None, dense) == AUTOEP_FOLDING_GRAD_REDUCE_SKIP


def _routed(tokens=6, top_k=2, experts=4, seed=0):
    """A router's flat top-k choices sorted by expert, as AutoEPMoELayer builds them."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, top_k, generator=g)
    choice = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    order = torch.argsort(choice.reshape(-1), stable=True)
    experts_sorted = choice.reshape(-1)[order]
    zeros = torch.zeros(order.numel(), dtype=torch.bool)
    payload = RoutedAssignmentPayload(
        token_indices=order // top_k, expert_indices=experts_sorted,
        assignment_indices=assignment_ordinals_by_expert(experts_sorted), capacity_slots=order % top_k,
        combine_weights=scores.reshape(-1)[order], drop_mask=zeros, pad_mask=zeros.clone(),
        input_splits=torch.bincount(experts_sorted // 2, minlength=2).tolist(),
        output_splits=torch.bincount(experts_sorted // 2, minlength=2).tolist(),
        extra={"destination_ranks": experts_sorted // 2, "num_tokens": tokens})
    return payload, scores, order


def test_partition_splits_every_expert_over_the_lanes_once():
    payload, _, _ = _routed(tokens=7, top_k=2)
    parts = [partition_assignments(payload, tp_group=None, tp_rank=r, tp_size=2) for r in range(2)]
    rows = [ctx.local_indices.tolist() for _, ctx in parts]
    assert sorted(rows[0] + rows[1]) == list(range(payload.token_indices.numel()))
    for expert in payload.expert_indices.unique():
        counts = [int((local.expert_indices == expert).sum()) for local, _ in parts]
        assert abs(counts[0] - counts[1]) <= 1  # each expert's work is halved, not one lane's
    assert sum(local.input_splits[0] + local.input_splits[1] for local, _ in parts) == 14
    assert dispatch_counters(parts[0][1])["assignments_total"] == 14


def test_restore_equals_the_unpartitioned_combine_bitwise():
    payload, scores, order = _routed(tokens=5, top_k=2)
    outputs = torch.randn(order.numel(), 3, generator=torch.Generator().manual_seed(1))
    want = combine_from_routed(outputs, scores, order, 2, "post", "weighted_sum", (1, 5, 3)).reshape(5, 3)
    local, ctx = partition_assignments(payload, tp_group=None, tp_rank=0, tp_size=1)
    got = restore_combined(outputs.index_select(0, ctx.local_indices), ctx, tp_group=None, validate_coverage=True)
    assert torch.equal(got, want)
    ctx.local_indices = ctx.local_indices[1:]
    with pytest.raises(RuntimeError, match="restore coverage mismatch"):
        restore_combined(outputs[1:], ctx, tp_group=None, validate_coverage=True)
