"""Expert-parallel / expert-data-parallel groups: DeepSpeed's rank lists, then real gloo groups on 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

from ds_moe import groups
from ds_moe.rank_lists import expert_and_data_parallel_ranks, expert_parallel_ranks_with_mpu

# --------------------------------------------------------- pure rank lists (DeepSpeed's documented examples)


def test_e_plus_d_layout_world16_ep2():
    ep, edp = expert_and_data_parallel_ranks(16, 2)
    assert ep == [[2 * i, 2 * i + 1] for i in range(8)]
    assert edp == [list(range(0, 16, 2)), list(range(1, 16, 2))]


def test_d_plus_e_layout_world16_ep2():
    ep, edp = expert_and_data_parallel_ranks(16, 2, use_data_before_expert_parallel_=True)
    assert ep == [[i, i + 8] for i in range(8)]
    assert edp == [list(range(8)), list(range(8, 16))]


def test_pipeline_stages_keep_groups_inside_a_stage():
    ep, edp = expert_and_data_parallel_ranks(8, 2, pp_size=2)
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert edp == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_tensor_parallel_strided_layout():
    ep, edp = expert_and_data_parallel_ranks(8, 2, mp_size=2)  # stage reordered TP-lane-major: 0 2 4 6 1 3 5 7
    assert ep == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert edp == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert expert_and_data_parallel_ranks(8, 2, mp_size=2, mp_mode="sp")[0] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_mpu_layout_world16_tp2_ep4():
    ep, edp = expert_parallel_ranks_with_mpu(16, 2, 4)
    assert ep == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert edp == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]


@pytest.mark.parametrize(("call", "words"), [
    (lambda: expert_and_data_parallel_ranks(4, 3), ["ep_size=3", "world size 4"]),
    (lambda: expert_and_data_parallel_ranks(8, 3, pp_size=2), ["ep_size=3", "4 ranks of a pipeline stage"]),
    (lambda: expert_and_data_parallel_ranks(4, 0), ["ep_size must be a positive int, got 0"]),
    (lambda: expert_parallel_ranks_with_mpu(16, 2, 3), ["ep_size=3", "data parallel size 8"]),
])
def test_sizes_that_do_not_divide_are_value_errors(call, words):
    with pytest.raises(ValueError) as err:
        call()
    for word in words:
        assert word in str(err.value)


def test_accessors_without_groups_say_how_to_create_them():
    with pytest.raises(RuntimeError, match="init_process_group"):
        groups._create_expert_and_data_parallel(1)
    with pytest.raises(RuntimeError, match="'ep_size_2' is not initialized"):
        groups._get_expert_parallel_group("ep_size_2")


# --------------------------------------------------------------------------------------- gloo


def _members(group) -> list[int]:
    onehot = torch.zeros(dist.get_world_size())
    onehot[dist.get_rank()] = 1.0
    dist.all_reduce(onehot, group=group)
    return [r for r, v in enumerate(onehot.tolist()) if v == 1.0]


def _probe(ep_size: int, data_before: bool) -> dict:
    groups._create_expert_and_data_parallel(ep_size, use_data_before_expert_parallel_=data_before)
    name = f"ep_size_{ep_size}"
    before = (groups._get_expert_parallel_group(name), groups._get_expert_data_parallel_group(name))
    groups._create_expert_and_data_parallel(ep_size)  # idempotent: nothing new
    return {
        "ep": _members(groups._get_expert_parallel_group(name)),
        "edp": _members(groups._get_expert_data_parallel_group(name)),
        "ep_ranks": groups._get_expert_parallel_group_ranks(name),
        "edp_ranks": groups._get_expert_data_parallel_group_ranks(name),
        "sizes": (groups._get_expert_parallel_world_size(name), groups._get_expert_data_parallel_world_size(name)),
        "ranks": (groups._get_expert_parallel_rank(name), groups._get_expert_data_parallel_rank(name)),
        "same": before == (groups._get_expert_parallel_group(name), groups._get_expert_data_parallel_group(name)),
        "names": (sorted(groups._get_expert_parallel_group_dict()),
                  sorted(groups._get_expert_data_parallel_group_dict())),
        "max": (groups._get_max_expert_size(), groups._get_max_expert_size_name()),
        "src": groups._get_expert_broadcast_src_rank(name),
    }


@pytest.mark.parametrize(("world", "ep_size", "data_before", "want_ep", "want_edp"), [
    (4, 2, False, [[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]),
    (4, 2, True, [[0, 2], [1, 3], [0, 2], [1, 3]], [[0, 1], [0, 1], [2, 3], [2, 3]]),
    (2, 2, False, [[0, 1], [0, 1]], [[0], [1]]),
    (4, 4, False, [[0, 1, 2, 3]] * 4, [[0], [1], [2], [3]]),
], ids=["w4ep2", "w4ep2-data-first", "w2ep2", "w4ep4"])
def test_expert_groups_on_gloo(world, ep_size, data_before, want_ep, want_edp):
    got = run_distributed(_probe, world_size=world, args=(ep_size, data_before), timeout=60)
    name = f"ep_size_{ep_size}"
    for rank, g in enumerate(got):
        assert g["ep"] == g["ep_ranks"] == want_ep[rank], rank
        assert g["edp"] == g["edp_ranks"] == want_edp[rank], rank
        assert g["sizes"] == (len(want_ep[rank]), len(want_edp[rank]))
        assert g["ranks"] == (want_ep[rank].index(rank), want_edp[rank].index(rank))
        assert g["same"] and g["names"] == ([name], [name]) and g["max"] == (ep_size, name)
        assert g["src"] == want_edp[rank][0]


def _two_sizes_and_a_bad_one() -> dict:
    groups._create_expert_and_data_parallel(2)
    groups._create_expert_and_data_parallel(4)
    try:
        groups._create_expert_and_data_parallel(3)
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    return {"names": sorted(groups._get_expert_parallel_group_dict()), "max": groups._get_max_expert_size_name(),
            "ep4": _members(groups._get_max_expert_parallel_group()), "error": error}


def test_several_expert_sizes_coexist_and_a_non_divisor_is_rejected():
    for got in run_distributed(_two_sizes_and_a_bad_one, world_size=4, timeout=60):
        assert got["names"] == ["ep_size_2", "ep_size_4"] and got["max"] == "ep_size_4"
        assert got["ep4"] == [0, 1, 2, 3]
        assert "ep_size=3" in got["error"] and "world size 4" in got["error"]
