"""``deepspeed.utils.groups._init_tp_mesh_device``: DeepSpeed's explicit data x tensor groups (tensor groups of
consecutive ranks), which then answer the public accessors before any registered mpu."""

from __future__ import annotations

import torch.distributed as dist
from _harness import run_distributed


def _body() -> dict:
    from deepspeed.utils import groups

    made = groups._init_tp_groups_with_new_group(tensor_model_parallel_size=2)
    again = groups._init_tp_mesh_device(tensor_model_parallel_size=2)  # already made: kept, returns None
    try:
        return {"data": dist.get_process_group_ranks(groups.get_data_parallel_group()),
                "tensor": dist.get_process_group_ranks(groups.get_tensor_model_parallel_group()),
                "model_is_tensor": groups.get_model_parallel_group() is made[1],
                "tp": (groups.get_tensor_model_parallel_world_size(), groups.get_tensor_model_parallel_rank()),
                "again": again}
    finally:
        groups._set_tp_groups(None, None)


def test_explicit_tp_groups_answer_the_accessors():
    for rank, result in enumerate(run_distributed(_body, world_size=4, timeout=60)):
        assert result["data"] == [rank % 2, rank % 2 + 2]
        assert result["tensor"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert result["model_is_tensor"] and result["again"] is None
        assert result["tp"] == (2, rank % 2)


def _mesh_body() -> tuple:
    import deepspeed.comm as ds_comm

    mesh = ds_comm.initialize_mesh_device((2,), ("data",))
    return mesh.device_type, tuple(mesh.mesh.tolist()), mesh.mesh_dim_names


def test_initialize_mesh_device_is_a_torch_device_mesh():
    for out in run_distributed(_mesh_body, world_size=2, timeout=60):
        assert out == ("cpu", (0, 1), ("data",))
