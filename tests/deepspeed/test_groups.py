"""``deepspeed.utils.groups`` on real gloo ranks: without an mpu (data = world, model/tensor/sequence = this rank
alone), with a ``PipelineParallelGrid`` registered (every accessor reads the grid's groups), with a Megatron-style
mpu (tensor and sequence APIs win), the ``bwc_*`` lookup order, and the error before ``torch.distributed`` starts.
Membership is read with ``dist.get_process_group_ranks`` and confirmed by an all-reduce over the group."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

import deepspeed
from deepspeed.utils import groups
from ds_pipe import PipeDataParallelTopology, PipelineParallelGrid, PipeModelDataParallelTopology


def _ranks(group) -> list[int]:
    """Members by ``get_process_group_ranks``, checked against an all-reduce of this rank's one-hot vector."""
    members = sorted(dist.get_process_group_ranks(group))
    onehot = torch.zeros(dist.get_world_size())
    onehot[dist.get_rank()] = 1.0
    dist.all_reduce(onehot, group=group)
    assert [r for r, v in enumerate(onehot.tolist()) if v == 1.0] == members
    return members


def _snapshot() -> dict:
    """Every accessor's answer on this rank, groups as member lists."""
    return {
        "data": (_ranks(groups._get_data_parallel_group()), groups._get_data_parallel_world_size(),
                 groups._get_data_parallel_rank(), groups._get_data_parallel_group_ranks()),
        "model": (_ranks(groups._get_model_parallel_group()), groups._get_model_parallel_world_size(),
                  groups._get_model_parallel_rank()),
        "tensor": (_ranks(groups.get_tensor_model_parallel_group()), groups.get_tensor_model_parallel_world_size(),
                   groups.get_tensor_model_parallel_rank(), groups.get_tensor_model_parallel_src_rank()),
        "public_model": (_ranks(groups.get_model_parallel_group()), groups.get_model_parallel_world_size(),
                         groups.get_model_parallel_rank()),
        "public_data": (_ranks(groups.get_data_parallel_group()), groups.get_data_parallel_world_size(),
                        groups.get_data_parallel_rank()),
        "seq": (_ranks(groups._get_sequence_parallel_group()), groups._get_sequence_parallel_world_size(),
                groups._get_sequence_parallel_rank()),
        "seq_data": (_ranks(groups._get_sequence_data_parallel_group()),
                     groups._get_sequence_data_parallel_world_size(), groups._get_sequence_data_parallel_rank()),
        "src": groups._get_broadcast_src_rank(),
        "pipe": _pipe(),
    }


def _pipe() -> tuple:
    """(stages, pipeline group members or False) of the registered mpu."""
    try:
        group = groups.bwc_pipeline_parallel_group(groups.mpu)
    except AttributeError:  # an mpu without a pipeline API
        group = None
    return groups.bwc_pipeline_parallel_world_size(groups.mpu), group is not None and _ranks(group)


def _without_mpu() -> dict:
    groups.register_mpu(None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:  # only this rank makes its one-rank group: the next collective new_group still lines up
        groups.get_tensor_model_parallel_group()
    pair = dist.new_group([0, 1])
    if rank in (0, 1):
        assert _ranks(pair) == [0, 1]
    out = _snapshot()
    mine = groups.get_tensor_model_parallel_group()
    out["one_group"] = mine is groups._get_model_parallel_group() is groups._get_sequence_parallel_group()
    groups.set_tensor_model_parallel_world_size(world)
    groups.set_tensor_model_parallel_rank(rank)
    out["override"] = (groups.get_model_parallel_world_size(), groups.get_tensor_model_parallel_rank())
    groups.set_tensor_model_parallel_world_size(None)
    groups.set_tensor_model_parallel_rank(None)
    out["cleared"] = (groups.get_tensor_model_parallel_world_size(), groups.get_tensor_model_parallel_rank())
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_without_an_mpu_data_is_the_world_and_the_rest_is_this_rank(world):
    everyone = list(range(world))
    for rank, got in enumerate(run_distributed(_without_mpu, world_size=world, timeout=60)):
        me = [rank]
        assert got["data"] == (everyone, world, rank, everyone)
        assert got["public_data"] == (everyone, world, rank)
        assert got["seq_data"] == (everyone, world, rank)
        assert got["model"] == (me, 1, 0) and got["public_model"] == (me, 1, 0) and got["seq"] == (me, 1, 0)
        assert got["tensor"] == (me, 1, 0, rank)
        assert got["src"] == 0 and got["pipe"] == (1, False) and got["one_group"]
        assert got["override"] == (world, rank) and got["cleared"] == (1, 0)


def _with_grid(topo, assign: bool) -> dict:
    grid = PipelineParallelGrid(topo)
    if assign:  # how DeepSpeed clients set it
        groups.mpu = grid
    else:
        groups.register_mpu(grid)
    try:
        out = _snapshot()
        out["registered"] = groups.registered_mpu() is grid
        out["grid"] = {
            "data": (_ranks(grid.get_data_parallel_group()), grid.get_data_parallel_world_size(),
                     grid.get_data_parallel_rank()),
            "model": (_ranks(grid.get_model_parallel_group()), grid.get_model_parallel_world_size(),
                      grid.get_model_parallel_rank()),
            "slice": (_ranks(grid.get_slice_parallel_group()), grid.get_slice_parallel_world_size(),
                      grid.get_slice_parallel_rank()),
            "pipe": (grid.get_pipe_parallel_world_size(), _ranks(grid.get_pipe_parallel_group()))}
        out["same_objects"] = (groups._get_data_parallel_group() is grid.get_data_parallel_group(),
                               groups._get_model_parallel_group() is grid.get_model_parallel_group(),
                               groups.get_tensor_model_parallel_group() is grid.get_slice_parallel_group(),
                               groups.bwc_pipeline_parallel_group(grid) is grid.get_pipe_parallel_group())
        return out
    finally:
        groups.register_mpu(None)


def test_pipe_data_grid_is_the_source_of_every_group():
    """2 stages x 2 data-parallel replicas: data peers are adjacent ranks, the model group is one replica."""
    got = run_distributed(_with_grid, world_size=4, args=(PipeDataParallelTopology(num_pp=2, num_dp=2), True),
                          timeout=60)
    for rank, g in enumerate(got):
        grid = g["grid"]
        assert g["registered"] and all(g["same_objects"])
        assert g["data"] == (*grid["data"], grid["data"][0])
        assert g["data"][0] == [[0, 1], [0, 1], [2, 3], [2, 3]][rank] and g["data"][1:3] == (2, rank % 2)
        assert g["model"] == grid["model"] and g["model"][0] == [[0, 2], [1, 3]][rank % 2]
        assert g["tensor"] == ([rank], 1, 0, rank) and g["public_model"] == ([rank], 1, 0)
        assert g["pipe"] == grid["pipe"] == (2, [[0, 2], [1, 3]][rank % 2])
        assert g["seq"] == ([rank], 1, 0) and g["seq_data"] == g["public_data"] == g["data"][:3]
        assert g["src"] == g["data"][0][0]


def test_tensor_group_is_the_grids_slice_group():
    """1 stage x 2 replicas x 2 tensor slices: the tensor group is the slice group, data peers are 2 apart."""
    got = run_distributed(_with_grid, world_size=4,
                          args=(PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=2), False), timeout=60)
    for rank, g in enumerate(got):
        pair = [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert g["registered"] and all(g["same_objects"])
        assert g["tensor"] == (g["grid"]["slice"][0], 2, rank % 2, pair[0]) and g["tensor"][0] == pair
        assert g["public_model"] == g["tensor"][:3]
        assert g["data"][:3] == g["grid"]["data"] == ([rank % 2, rank % 2 + 2], 2, rank // 2)
        assert g["model"] == g["grid"]["model"] and g["pipe"] == (1, [rank])


class _MegatronStyleMpu:
    """A Megatron-style mpu on 4 ranks: tensor pairs {0,1},{2,3}; sequence pairs {0,2},{1,3}; data = sequence-data
    = the world. It also has the old slice/model APIs, which must lose to the tensor one."""

    def __init__(self) -> None:
        rank = dist.get_rank()
        pairs = {"tp": [[0, 1], [2, 3]], "sp": [[0, 2], [1, 3]]}
        self.made = {k: [dist.new_group(p) for p in v] for k, v in pairs.items()}
        self.tp = self.made["tp"][rank // 2]
        self.sp = self.made["sp"][rank % 2]

    def get_tensor_model_parallel_group(self):
        return self.tp

    def get_tensor_model_parallel_world_size(self):
        return 2

    def get_tensor_model_parallel_rank(self):
        return dist.get_rank(self.tp)

    def get_slice_parallel_group(self):
        raise AssertionError("the tensor API comes first")

    get_slice_parallel_world_size = get_slice_parallel_rank = get_slice_parallel_group

    def get_data_parallel_group(self):
        return dist.group.WORLD

    def get_data_parallel_world_size(self):
        return dist.get_world_size()

    def get_sequence_parallel_group(self):
        return self.sp

    def get_sequence_parallel_world_size(self):
        return 2

    def get_sequence_parallel_rank(self):
        return dist.get_rank(self.sp)

    def get_sequence_data_parallel_group(self):
        return self.sp  # deliberately not the data group, to see which one is read

    def get_sequence_data_parallel_world_size(self):
        return 2

    def get_sequence_data_parallel_rank(self):
        return dist.get_rank(self.sp)


def _with_megatron_mpu() -> dict:
    groups.register_mpu(_MegatronStyleMpu())
    try:
        out = _snapshot()
        out["model_group_is_self"] = groups._get_model_parallel_group() is groups._self_group()
        return out
    finally:
        groups.register_mpu(None)


def test_megatron_style_mpu_supplies_tensor_and_sequence_groups():
    for rank, g in enumerate(run_distributed(_with_megatron_mpu, world_size=4, timeout=60)):
        tp, sp = [2 * (rank // 2), 2 * (rank // 2) + 1], [rank % 2, rank % 2 + 2]
        assert g["tensor"] == (tp, 2, rank % 2, tp[0]) and g["public_model"] == (tp, 2, rank % 2)
        assert g["seq"] == g["seq_data"] == (sp, 2, rank // 2) and g["src"] == sp[0]
        assert g["data"] == ([0, 1, 2, 3], 4, rank, [0, 1, 2, 3])
        assert g["model"] == ([rank], 1, 0) and g["model_group_is_self"]  # it has no get_model_parallel_*
        assert g["pipe"] == (1, False)


class _Api:
    """An object answering only the methods given (name -> value)."""

    def __init__(self, **answers) -> None:
        for name, value in answers.items():
            setattr(self, name, lambda value=value: value)


def test_bwc_lookup_order_and_defaults():
    assert (groups.bwc_tensor_model_parallel_rank(), groups.bwc_tensor_model_parallel_world_size()) == (0, 1)
    assert groups.bwc_tensor_model_parallel_group() is None and groups.bwc_pipeline_parallel_group() is None
    assert groups.bwc_pipeline_parallel_world_size() == 1
    old = _Api(get_model_parallel_rank=3, get_model_parallel_world_size=4, get_model_parallel_group="m")
    grid = _Api(get_slice_parallel_rank=1, get_slice_parallel_world_size=2, get_slice_parallel_group="s",
                get_model_parallel_rank=3, get_model_parallel_world_size=4, get_model_parallel_group="m",
                get_pipe_parallel_world_size=5, get_pipe_parallel_group="p")
    new = _Api(get_tensor_model_parallel_rank=0, get_tensor_model_parallel_world_size=8,
               get_tensor_model_parallel_group="t", get_slice_parallel_group="s",
               get_pipeline_model_parallel_world_size=6, get_pipeline_model_parallel_group="pp",
               get_pipe_parallel_world_size=5)
    got = [(groups.bwc_tensor_model_parallel_rank(m), groups.bwc_tensor_model_parallel_world_size(m),
            groups.bwc_tensor_model_parallel_group(m), groups.bwc_pipeline_parallel_world_size(m))
           for m in (old, grid, new)]
    assert got == [(3, 4, "m", 1), (1, 2, "s", 5), (0, 8, "t", 6)]
    assert (groups.bwc_pipeline_parallel_group(grid), groups.bwc_pipeline_parallel_group(new)) == ("p", "pp")
    with pytest.raises(AttributeError, match="no pipeline group"):
        groups.bwc_pipeline_parallel_group(old)
    with pytest.raises(AttributeError, match="get_tensor_model_parallel_group"):
        groups.bwc_tensor_model_parallel_group(_Api())


@pytest.mark.parametrize("accessor", ["_get_data_parallel_group", "_get_data_parallel_world_size",
                                      "_get_model_parallel_world_size", "get_tensor_model_parallel_group",
                                      "get_tensor_model_parallel_rank", "_get_sequence_parallel_world_size",
                                      "_get_sequence_data_parallel_group", "_get_broadcast_src_rank"])
def test_accessors_before_init_say_what_to_call(accessor):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"call deepspeed\.init_distributed\(\) \(or deepspeed\.initialize\)"):
        getattr(groups, accessor)()


def test_register_mpu_and_module_attribute_agree():
    marker = object()
    try:
        groups.register_mpu(marker)
        assert groups.mpu is marker and groups.registered_mpu() is marker
        groups.mpu = None
        assert groups.registered_mpu() is None
    finally:
        groups.register_mpu(None)


def test_documented_path_is_this_module():
    assert importlib.import_module("deepspeed.utils.groups") is groups is deepspeed.utils.groups
