"""``PipelineParallelGrid`` on real gloo ranks: the groups it creates hold exactly the ranks the topology says
(checked by all-reduce of one-hot rank vectors), its mpu accessors agree with those groups, and neighbours
found through ``stage_to_global`` / ``prev_rank`` / ``next_rank`` exchange tensors point-to-point."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

from ds_pipe import PipeDataParallelTopology, PipelineParallelGrid, PipeModelDataParallelTopology, ProcessTopology


def _members(group, world: int) -> list[int]:
    """The global ranks of ``group``, found by all-reducing a one-hot vector of this rank."""
    onehot = torch.zeros(world)
    onehot[dist.get_rank()] = 1.0
    dist.all_reduce(onehot, group=group)
    return [r for r in range(world) if onehot[r] == 1.0]


def _exchange(grid: PipelineParallelGrid) -> tuple[int | None, int | None]:
    """Send this rank to the next stage and receive from the previous one: (got from prev, prev_rank)."""
    ops = []
    got = torch.tensor([-1])
    if grid.next_rank is not None:
        ops.append(dist.P2POp(dist.isend, torch.tensor([dist.get_rank()]), grid.next_rank))
    if grid.prev_rank is not None:
        ops.append(dist.P2POp(dist.irecv, got, grid.prev_rank))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return (None if grid.prev_rank is None else int(got.item())), grid.prev_rank


def _probe(topology: ProcessTopology | None) -> dict:
    world = dist.get_world_size()
    grid = PipelineParallelGrid(topology=topology)
    groups = {"pipe": grid.get_pipe_parallel_group(), "data": grid.get_data_parallel_group(),
              "model": grid.get_model_parallel_group(), "slice": grid.get_slice_parallel_group()}
    out = {"members": {k: _members(g, world) for k, g in groups.items()},
           "group_rank": {k: dist.get_rank(g) for k, g in groups.items()},
           "group_size": {k: dist.get_world_size(g) for k, g in groups.items()}}
    out["rank"] = {"pipe": grid.get_pipe_parallel_rank(), "data": grid.get_data_parallel_rank(),
                   "model": grid.get_model_parallel_rank(), "slice": grid.get_slice_parallel_rank()}
    out["size"] = {"pipe": grid.get_pipe_parallel_world_size(), "data": grid.get_data_parallel_world_size(),
                   "model": grid.get_model_parallel_world_size(), "slice": grid.get_slice_parallel_world_size()}
    out.update(global_rank=grid.get_global_rank(), stage_id=grid.stage_id, get_stage_id=grid.get_stage_id(),
               data_parallel_id=grid.data_parallel_id, first=grid.is_first_stage, last=grid.is_last_stage,
               prev_stage=grid.prev_stage, next_stage=grid.next_stage, p2p=grid.p2p_groups,
               stages=[grid.stage_to_global(s) for s in range(grid.pipe_parallel_size)],
               exchange=_exchange(grid), topo_is_given=topology is None or grid.topology() is topology,
               axes=grid.topology().get_axis_names(), dims=grid.topology().dims)
    return out


def _expected(topo: ProcessTopology, rank: int) -> dict:
    """What the grid must report for ``rank``, computed from the topology alone."""
    coord = topo.get_coord(rank)
    stage, dp = coord.pipe, coord.data
    model = getattr(coord, "model", 0)

    def along(axis: str) -> list[int]:
        return next((g for g in topo.get_axis_comm_lists(axis) if rank in g), [rank])

    replica = topo.filter_match(data=dp)
    pp = topo.get_dim("pipe")
    return {
        "members": {"pipe": along("pipe"), "data": along("data"), "model": replica, "slice": along("model")},
        "rank": {"pipe": stage, "data": dp, "model": replica.index(rank), "slice": model},
        "size": {"pipe": pp, "data": topo.get_dim("data"), "model": len(replica),
                 "slice": max(topo.get_dim("model"), 1)},
        "stage_id": stage, "data_parallel_id": dp, "first": stage == 0, "last": stage == pp - 1,
        "prev_stage": stage - 1, "next_stage": stage + 1, "stages": along("pipe"),
        "p2p": [[r, next(g for g in topo.get_axis_comm_lists("pipe") if r in g)[
            (topo.get_coord(r).pipe + 1) % pp]] for r in range(topo.world_size())],
    }


def _check(results: list[dict], topo: ProcessTopology) -> None:
    for rank, got in enumerate(results):
        want = _expected(topo, rank)
        for key, value in want.items():
            assert got[key] == value, (rank, key, got[key], value)
        assert got["group_rank"] == got["rank"] and got["group_size"] == got["size"], rank
        assert got["global_rank"] == rank and got["get_stage_id"] == got["stage_id"] and got["topo_is_given"]
        prev = None if want["first"] else want["stages"][want["stage_id"] - 1]
        assert got["exchange"] == (prev, prev), (rank, got["exchange"])


@pytest.mark.parametrize("topo", [
    PipeDataParallelTopology(num_pp=2, num_dp=2),
    PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1),  # pipe x data x model = 2 x 1 x 2
    PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=2),
    PipeDataParallelTopology(num_pp=4, num_dp=1),
], ids=["pp2xdp2", "pp2xdp1xmp2", "pp1xdp2xmp2", "pp4"])
def test_grid_groups_on_four_ranks(topo):
    _check(run_distributed(_probe, world_size=4, args=(topo,), timeout=60), topo)


def test_grid_2x2_concrete_groups():
    """The 2x2 grid written out: data peers are adjacent ranks, stages are 2 apart."""
    got = run_distributed(_probe, world_size=4, args=(PipeDataParallelTopology(num_pp=2, num_dp=2),), timeout=60)
    assert [g["members"]["data"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["members"]["pipe"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["members"]["model"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["members"]["slice"] for g in got] == [[0], [1], [2], [3]]
    assert got[0]["p2p"] == [[0, 2], [1, 3], [2, 0], [3, 1]]
    assert [(g["first"], g["last"]) for g in got] == [(True, False), (True, False), (False, True), (False, True)]


def test_grid_without_a_topology_uses_deepspeeds_default():
    got = run_distributed(_probe, world_size=4, args=(None,), timeout=60)
    assert {(tuple(g["axes"]), tuple(g["dims"])) for g in got} == {(("pipe", "data"), (2, 2))}
    _check(got, PipeDataParallelTopology(num_pp=2, num_dp=2))


def _stage_to_global_with_overrides() -> list:
    grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2))
    return [grid.stage_to_global(1), grid.stage_to_global(0, data=1), grid.stage_to_global(1, model=0, data=0),
            grid._is_grid_valid()]


def test_stage_to_global_keeps_the_other_coordinates_unless_overridden():
    got = run_distributed(_stage_to_global_with_overrides, world_size=8, timeout=60)
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    for rank, ranks in enumerate(got):
        c = topo.get_coord(rank)
        assert ranks == [topo.get_rank(pipe=1, data=c.data, model=c.model),
                         topo.get_rank(pipe=0, data=1, model=c.model), topo.get_rank(pipe=1, data=0, model=0), True]


def _subgroup_grids() -> dict:
    """Ranks {0, 1} and {2, 3} each build their own two-stage grid over their own process group."""
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = halves[dist.get_rank() // 2]
    grid = PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=1), process_group=mine)
    return {"pipe": _members(grid.get_pipe_parallel_group(), 4), "stages": [grid.stage_to_global(s) for s in (0, 1)],
            "p2p": grid.p2p_groups, "stage": grid.stage_id, "exchange": _exchange(grid),
            "data": _members(grid.get_data_parallel_group(), 4)}


def test_grid_over_a_subgroup_maps_topology_ranks_to_its_members():
    got = run_distributed(_subgroup_grids, world_size=4, timeout=60)
    for rank, g in enumerate(got):
        base = 2 * (rank // 2)
        assert g["pipe"] == g["stages"] == [base, base + 1]
        assert g["p2p"] == [[base, base + 1], [base + 1, base]]
        assert g["stage"] == rank % 2 and g["data"] == [rank]
        assert g["exchange"] == ((None, None) if rank % 2 == 0 else (base, base))


def _bad_grid(case: str) -> str:
    try:
        if case == "size":
            PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=4))
        elif case == "type":
            PipelineParallelGrid(topology="2x2")
        else:
            grid = PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=2))
            grid.stage_to_global(2)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(("case", "words"), [
    ("size", ["ValueError", "PipeDataParallelTopology(axes=['pipe', 'data'], dims=[2, 4])", "8 ranks",
              "process group has 4"]),
    ("type", ["TypeError", "topology must be a ProcessTopology, got str"]),
    ("stage", ["ValueError", "stage_id=2 is out of range (0..1)"]),
])
def test_bad_grid_input_fails_on_every_rank(case, words):
    for message in run_distributed(_bad_grid, world_size=4, args=(case,), timeout=60):
        for word in words:
            assert word in message, message


def test_grid_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="init_process_group"):
        PipelineParallelGrid(PipeDataParallelTopology(num_pp=1, num_dp=1))


def _data_only() -> dict:
    grid = PipelineParallelGrid(ProcessTopology(axes=["data"], dims=[4]))
    return {"pipe": _members(grid.get_pipe_parallel_group(), 4), "data": _members(grid.get_data_parallel_group(), 4),
            "ids": (grid.stage_id, grid.data_parallel_id, grid.get_slice_parallel_rank()),
            "ends": (grid.is_first_stage, grid.is_last_stage, grid.prev_rank, grid.next_rank),
            "stage0": grid.stage_to_global(0)}


def test_grid_of_a_topology_without_pipe_axis_is_one_stage():
    """An absent axis has size 1 (one group per rank along it), as get_dim/get_axis_comm_lists allow."""
    for rank, g in enumerate(run_distributed(_data_only, world_size=4, timeout=60)):
        assert g == {"pipe": [rank], "data": [0, 1, 2, 3], "ids": (0, rank, 0), "ends": (True, True, None, None),
                     "stage0": rank}
