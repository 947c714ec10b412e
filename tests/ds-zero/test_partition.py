"""``ds_zero.partition``: FlatLayout arithmetic (which rank owns which slice of which tensor) and the
round-robin gradient order, checked against an element-by-element reference and with hypothesis properties;
and the re-partitioning of saved fp32 partitions onto another world size (``ds_zero.optimizer_state``), which relies on
the same arithmetic, checked by parameter name across layouts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_zero._flat_group import FlatGroup
from ds_zero.optimizer_state import BASE_STATE, FP32_GROUPS, _repartition
from ds_zero.partition import FlatLayout, Fragment, nccl_alignment, round_robin_order

numels_st = st.lists(st.integers(min_value=0, max_value=60), min_size=0, max_size=8)
world_st = st.integers(min_value=1, max_value=9)


def _owner_of_each_element(layout: FlatLayout) -> dict[tuple[int, int], tuple[int, int]]:
    """Reference: (tensor, element) -> (rank, position in that rank's partition), one element at a time."""
    out = {}
    for index, (offset, numel) in enumerate(zip(layout.offsets, layout.numels, strict=True)):
        for e in range(numel):
            flat = offset + e
            rank = flat // layout.partition_numel
            out[(index, e)] = (rank, flat - rank * layout.partition_numel)
    return out


def _elements_of_fragments(layout: FlatLayout) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    pairs = []
    for rank in range(layout.world_size):
        for f in layout.fragments(rank):
            pairs.extend(((f.index, f.tensor_offset + k), (rank, f.partition_offset + k)) for k in range(f.numel))
    return pairs


def test_worked_example_three_tensors_on_two_ranks():
    layout = FlatLayout([5, 3, 6], world_size=2)  # 14 elements, alignment 4 -> 16, partitions of 8
    assert (layout.alignment, layout.numel, layout.padded_numel, layout.padding) == (4, 14, 16, 2)
    assert layout.offsets == [0, 5, 8] and layout.partition_numel == 8
    assert layout.partition_range(0) == (0, 8) and layout.partition_range(1) == (8, 16)
    assert layout.fragments(0) == [Fragment(0, 0, 0, 0, 5), Fragment(1, 0, 5, 5, 3)]
    assert layout.fragments(1) == [Fragment(2, 0, 0, 8, 6)]
    assert layout.owners(0) == [(0, Fragment(0, 0, 0, 0, 5))]


def test_a_tensor_spanning_three_partitions():
    layout = FlatLayout([2, 20, 2], world_size=3)  # 24 elements: already a multiple of 6, partitions of 8
    assert layout.padding == 0 and layout.partition_numel == 8
    assert layout.owners(1) == [(0, Fragment(1, 0, 2, 2, 6)), (1, Fragment(1, 6, 0, 8, 8)),
                                (2, Fragment(1, 14, 0, 16, 6))]
    assert layout.fragments(2) == [Fragment(1, 14, 0, 16, 6), Fragment(2, 0, 6, 22, 2)]


def test_empty_and_zero_sized_tensors():
    empty = FlatLayout([], world_size=4)
    assert (empty.numel, empty.padded_numel, empty.partition_numel) == (0, 0, 0)
    assert all(empty.fragments(r) == [] for r in range(4))
    zeros = FlatLayout([0, 3, 0], world_size=2)
    assert zeros.owners(0) == [] and zeros.owners(2) == []
    assert zeros.padded_numel == 4 and [f.index for r in range(2) for f in zeros.fragments(r)] == [1, 1]


def test_explicit_alignment_and_default():
    assert nccl_alignment(1) == 2 and nccl_alignment(4) == 8
    layout = FlatLayout([10], world_size=4, alignment=16)
    assert layout.padded_numel == 16 and layout.partition_numel == 4
    assert FlatLayout([10], world_size=4).padded_numel == 16  # default 2 * 4 = 8 -> 16 as well
    assert FlatLayout([9], world_size=3).padded_numel == 12  # 2 * 3 = 6 -> 12


@pytest.mark.parametrize("kwargs, words", [
    ({"numels": [3], "world_size": 0}, ["world_size", "0"]),
    ({"numels": [3, -1], "world_size": 2}, ["element counts", "-1"]),
    ({"numels": [3], "world_size": 4, "alignment": 6}, ["alignment 6", "world_size 4"]),
])
def test_bad_arguments_name_the_value(kwargs, words):
    with pytest.raises(ValueError) as info:
        FlatLayout(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


@settings(max_examples=150, deadline=None)
@given(numels=numels_st, world=world_st, extra=st.integers(min_value=1, max_value=3))
def test_fragments_tile_every_tensor_exactly_once(numels, world, extra):
    layout = FlatLayout(numels, world, alignment=2 * world * extra)
    pairs = _elements_of_fragments(layout)
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)) == sum(numels)  # no element twice, none missing
    assert dict(pairs) == _owner_of_each_element(layout)  # and each at the place the reference puts it
    slots = [v for _, v in pairs]
    assert len(slots) == len(set(slots))  # no two elements share a partition slot


@settings(max_examples=150, deadline=None)
@given(numels=numels_st, world=world_st)
def test_partitions_equal_aligned_and_contiguous(numels, world):
    layout = FlatLayout(numels, world)
    assert layout.alignment == 2 * world
    assert layout.padded_numel % layout.alignment == 0
    assert 0 <= layout.padding < layout.alignment if sum(numels) else layout.padded_numel == 0
    assert layout.padded_numel == layout.numel + layout.padding and layout.numel == sum(numels)
    ranges = [layout.partition_range(r) for r in range(world)]
    assert all(end - start == layout.partition_numel for start, end in ranges)
    assert [s for s, _ in ranges] == [r * layout.partition_numel for r in range(world)]
    assert ranges[-1][1] == layout.padded_numel
    assert layout.offsets == [sum(numels[:i]) for i in range(len(numels))]


@settings(max_examples=150, deadline=None)
@given(numels=numels_st, world=world_st)
def test_fragment_fields_are_consistent(numels, world):
    layout = FlatLayout(numels, world)
    for rank in range(world):
        start, end = layout.partition_range(rank)
        frags = layout.fragments(rank)
        assert [f.flat_offset for f in frags] == sorted(f.flat_offset for f in frags)  # flat order
        for f in frags:
            assert f.numel > 0
            assert f.flat_offset == layout.offsets[f.index] + f.tensor_offset
            assert f.partition_offset == f.flat_offset - start
            assert start <= f.flat_offset and f.flat_offset + f.numel <= end
            assert f.tensor_offset + f.numel <= numels[f.index]
        # what a rank holds is its fragments plus (last ranks only) padding
        held = sum(f.numel for f in frags)
        assert held == max(0, min(end, layout.numel) - start)


@settings(max_examples=150, deadline=None)
@given(numels=numels_st, world=world_st)
def test_owners_agree_with_fragments(numels, world):
    layout = FlatLayout(numels, world)
    for index in range(len(numels)):
        from_fragments = [(r, f) for r in range(world) for f in layout.fragments(r) if f.index == index]
        assert layout.owners(index) == from_fragments
        assert sum(f.numel for _, f in layout.owners(index)) == numels[index]
        ranks = [r for r, _ in layout.owners(index)]
        assert ranks == sorted(set(ranks))  # one piece per rank, in rank order


def test_round_robin_order_example():
    assert round_robin_order([1] * 7, 3) == [0, 3, 6, 1, 4, 2, 5]
    assert round_robin_order([4, 5], 1) == [0, 1]
    assert round_robin_order([], 2) == []


@settings(max_examples=100, deadline=None)
@given(numels=numels_st, world=world_st)
def test_round_robin_order_is_a_permutation_grouped_by_index_mod_world(numels, world):
    order = round_robin_order(numels, world)
    assert sorted(order) == list(range(len(numels)))
    residues = [i % world for i in order]
    assert residues == sorted(residues)  # all of list 0, then list 1, ...
    for r in range(world):
        members = [i for i in order if i % world == r]
        assert members == sorted(members)  # each list keeps the original order


# ---- re-partitioning saved partitions for another world size ------------------------------------------------------
PAD = 1e9  # what sits in the saved padding: it must never reach a parameter


def _group(numels: list[int], world: int, rank: int, round_robin: bool) -> FlatGroup:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
    return FlatGroup(params, [f"p{i}" for i in range(len(numels))], world, rank, torch.float32,
                     torch.device("cpu"), round_robin=round_robin)


def _saved_rank_state(fg: FlatGroup, values: dict[str, torch.Tensor]) -> dict:
    """What rank ``fg.rank`` would have saved: its fp32 partition and an Adam-like moment (2x the values)."""
    part = torch.full((fg.layout.partition_numel,), PAD)
    for f in fg.own:
        part[f.partition_offset:f.partition_offset + f.numel] = \
            values[fg.names[f.index]][f.tensor_offset:f.tensor_offset + f.numel]
    return {FP32_GROUPS: [part],
            BASE_STATE: {"state": {0: {"exp_avg": part * 2, "step": torch.tensor(7.0)}},
                         "param_groups": [{"lr": 0.1, "params": [0]}]},
            "zero_layout": [{"names": list(fg.names), "numels": list(fg.layout.numels),
                             "alignment": fg.layout.alignment}]}


@settings(max_examples=60, deadline=None)
@given(numels=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=6),
       old_world=st.integers(min_value=1, max_value=5), new_world=st.integers(min_value=1, max_value=5),
       old_rr=st.booleans(), new_rr=st.booleans())
def test_repartition_moves_every_value_to_its_new_owner(numels, old_world, new_world, old_rr, new_rr):
    gen = torch.Generator().manual_seed(sum(numels) + 31 * old_world)
    values = {f"p{i}": torch.randn(n, generator=gen) for i, n in enumerate(numels)}
    states = [_saved_rank_state(_group(numels, old_world, r, old_rr), values) for r in range(old_world)]
    for rank in range(new_world):
        fg = _group(numels, new_world, rank, new_rr)
        (master,), base = _repartition(SimpleNamespace(groups=[fg]), states)
        assert master.shape == (fg.layout.partition_numel,) and master.dtype == torch.float32
        expected = torch.zeros(fg.layout.partition_numel)  # new padding: zeros, never the old padding
        for f in fg.own:
            expected[f.partition_offset:f.partition_offset + f.numel] = \
                values[fg.names[f.index]][f.tensor_offset:f.tensor_offset + f.numel]
        assert torch.equal(master, expected)
        state = base["state"][0]
        assert torch.equal(state["exp_avg"], expected * 2) and float(state["step"]) == 7.0
        assert base["param_groups"] == [{"lr": 0.1, "params": [0]}]


def test_repartition_names_missing_and_unexpected_parameters():
    states = [_saved_rank_state(_group([4, 6], 2, r, False), {"p0": torch.ones(4), "p1": torch.ones(6)})
              for r in range(2)]
    states[0]["zero_layout"][0]["names"] = ["p0", "other"]
    with pytest.raises(ValueError, match=r"\['p1'\] are not in the checkpoint and \['other'\]"):
        _repartition(SimpleNamespace(groups=[_group([4, 6], 1, 0, False)]), states)
