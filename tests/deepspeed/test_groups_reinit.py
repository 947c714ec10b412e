"""``deepspeed.utils.groups`` across ``destroy_process_group`` and a new ``init_process_group`` in the same process
(a reused worker, a notebook restarting its run): the data x tensor groups of ``_init_tp_mesh_device`` and the
expert groups are never handed out from the destroyed world; they are forgotten and built again on request."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

from deepspeed.utils import groups


def _init(store_dir: str, round_: int) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(os.path.join(store_dir, f"store{round_}"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def _members(group) -> list[int]:
    """Members, confirmed by a sum over the group (a destroyed group could not carry it)."""
    members = sorted(dist.get_process_group_ranks(group))
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total, group=group)
    assert total.item() == float(sum(members))
    return members


def _build(ep_size: int) -> dict:
    assert groups._init_tp_mesh_device(tensor_model_parallel_size=2) is not None  # built, not "kept the first"
    groups._create_expert_and_data_parallel(ep_size)
    name = f"ep_size_{ep_size}"
    return {"tp": groups.get_tensor_model_parallel_group(), "dp": groups.get_data_parallel_group(),
            "ep": groups._get_expert_parallel_group(name), "edp": groups._get_expert_data_parallel_group(name)}


def _across_reinit(store_dir: str) -> dict:
    groups.register_mpu(None)
    _init(store_dir, 0)
    first = _build(2)
    before = {kind: _members(group) for kind, group in first.items()}
    dist.barrier()
    dist.destroy_process_group()

    # between the worlds: nothing stale comes back
    with pytest.raises(RuntimeError, match="not initialised"):
        groups.get_tensor_model_parallel_group()
    with pytest.raises(RuntimeError, match="not initialized"):
        groups._get_expert_parallel_group("ep_size_2")

    _init(store_dir, 1)
    try:
        # a fresh process's answers: no tensor groups (this rank alone), no expert groups
        assert groups.get_tensor_model_parallel_world_size() == 1
        assert _members(groups.get_data_parallel_group()) == list(range(dist.get_world_size()))
        with pytest.raises(RuntimeError, match="ep_size_2.*not initialized"):
            groups._get_expert_parallel_group("ep_size_2")
        assert groups._get_expert_parallel_group_dict() == {}
        second = _build(2)  # built again under the new world
        reused = [kind for kind in first if second[kind] is first[kind]]
        after = {kind: _members(group) for kind, group in second.items()}
        dist.barrier()
    finally:
        dist.destroy_process_group()
        groups._drop_stale_tp_groups()  # leave the worker as a fresh process would be
    return {"before": before, "after": after, "reused": reused}


def test_groups_are_rebuilt_not_reused_after_reinit(tmp_path):
    results = run_distributed(_across_reinit, world_size=4, args=(str(tmp_path),), init_process_group=False,
                              timeout=90)
    for rank, result in enumerate(results):
        assert result["reused"] == []
        assert result["after"] == result["before"]  # the same layout, in new groups
        assert result["after"]["tp"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert result["after"]["ep"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert result["after"]["edp"] == [rank % 2, rank % 2 + 2]


class _SequenceMpu:
    """A sequence-parallel mpu of the first world (its group dies with it)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_sequence_parallel_world_size(self) -> int:
        return self.size


def _mpu_across_reinit(store_dir: str) -> dict:
    _init(store_dir, 0)
    registered = _SequenceMpu(2)
    groups.register_mpu(registered)
    first = groups._get_sequence_parallel_world_size()
    dist.destroy_process_group()
    _init(store_dir, 1)
    try:
        # the next world without an mpu: the first world's mpu must not answer (AutoEP would lay out its expert
        # groups for a sequence size of 2 on this rank and 1 on a fresh one, and the ranks' new_group calls part)
        second = groups._get_sequence_parallel_world_size()
        forgotten = groups.registered_mpu() is None
        groups.mpu = registered  # DeepSpeed clients' spelling, the same object again: registered in this world
        third = groups._get_sequence_parallel_world_size()
    finally:
        dist.destroy_process_group()
        groups.register_mpu(None)
    return {"first": first, "second": second, "forgotten": forgotten, "third": third}


def test_registered_mpu_is_forgotten_with_its_world(tmp_path):
    results = run_distributed(_mpu_across_reinit, world_size=2, args=(str(tmp_path),), init_process_group=False,
                              timeout=90)
    for result in results:
        assert result == {"first": 2, "second": 1, "forgotten": True, "third": 2}
