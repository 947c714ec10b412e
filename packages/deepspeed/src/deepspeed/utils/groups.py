"""``deepspeed.utils.groups``: DeepSpeed's process-group accessors, all read from one registered mpu.

The model-parallel unit (``ds_pipe.topology.PipelineParallelGrid``, a Megatron ``mpu``, ...) is the one source of
groups: ``register_mpu(grid)``, or ``groups.mpu = grid`` as DeepSpeed clients write it. Each accessor asks the mpu
first (through DeepSpeed's backward-compatible method names) and otherwise answers as DeepSpeed does without one:
data parallelism spans the world (the default group), model/tensor/sequence parallelism have size 1 (a group of
this rank alone, created on first use with a group-local barrier, so no other rank has to take part).

"Model parallel" has two meanings here, as in DeepSpeed: ``_get_model_parallel_*`` is the mpu's model group (for
the pipeline grid: every rank of one data-parallel replica, all stages and slices), while the public
``get_model_parallel_*`` is the tensor-parallel group (DeepSpeed's 2-D data x tensor API).
Expert-parallel and expert-data-parallel groups (``_create_expert_and_data_parallel``, ``_get_expert_*``,
``_get_max_expert_*``) are ``ds_moe.groups``' (MoE creates them per ``ep_size``); this module serves them by name.
Groups kept here belong to the default process group they were made under: after ``destroy_process_group`` they
are never handed out again (a process that initialises torch.distributed anew gets new ones on request, as a fresh
process would; ``ds_moe.groups`` does the same for the expert groups). The registered mpu too: its groups die with
the default group it was registered under, so it is forgotten then (register it again in the new world).
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed import ProcessGroup

import deepspeed.comm as dist
from deepspeed.utils.logging import log_dist

__all__ = [
    "bwc_pipeline_parallel_group",
    "bwc_pipeline_parallel_world_size",
    "bwc_tensor_model_parallel_group",
    "bwc_tensor_model_parallel_rank",
    "bwc_tensor_model_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "register_mpu",
    "registered_mpu",
    "set_tensor_model_parallel_rank",
    "set_tensor_model_parallel_world_size",
]

mpu: Any = None
"""The registered model-parallel unit (``None``: none), read by every accessor at call time."""

# Method names, newest convention first: Megatron/DeepSpeed tensor API, DeepSpeed pipeline grid, old Megatron.
_TENSOR = {kind: (f"get_tensor_model_parallel_{kind}", f"get_slice_parallel_{kind}", f"get_model_parallel_{kind}")
           for kind in ("rank", "world_size", "group")}
_PIPE = {kind: (f"get_pipeline_model_parallel_{kind}", f"get_pipe_parallel_{kind}") for kind in ("world_size", "group")}

_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE: int | None = None  # set_tensor_model_parallel_world_size() override
_MPU_TENSOR_MODEL_PARALLEL_RANK: int | None = None  # set_tensor_model_parallel_rank() override
_SELF_GROUP: tuple[Any, ProcessGroup] | None = None  # (default group it was made under, group of this rank)

# DeepSpeed's explicit data x tensor groups (``_init_tp_mesh_device``); when set they answer the public accessors
# before any mpu. ``_MODEL_PARALLEL_GROUP`` is the tensor group (2-D data x tensor parallelism).
_TENSOR_MODEL_PARALLEL_GROUP: Any = None
_MODEL_PARALLEL_GROUP: Any = None
_DATA_PARALLEL_GROUP: Any = None
_TP_GROUPS_OWNER: Any = None  # the default process group the three groups above were made under
_DEVICE_MESH_SPLIT_UNSUPPORTED = "No backend for the parent process group or its backend does not support splitting"


# (mpu, the default process group it was registered or first read under): an mpu's groups die with that group
_MPU_OWNER: list[Any] = [None, None]


def register_mpu(new_mpu: Any) -> None:
    """Make ``new_mpu`` the source of every group (``None`` unregisters it)."""
    global mpu
    mpu = new_mpu
    _MPU_OWNER[:] = [new_mpu, _default_group()]


def registered_mpu() -> Any:
    """The registered mpu, or ``None`` (also once the default process group it was registered under is destroyed:
    its groups went with it, and a reused process must not read them in its next world)."""
    global mpu
    if mpu is None:
        return None
    world = _default_group()
    if _MPU_OWNER[1] is None:  # registered before init_process_group
        _MPU_OWNER[1] = world
    elif world is not _MPU_OWNER[1]:
        mpu = None
        _MPU_OWNER[:] = [None, None]
    return mpu


# ---- backward-compatible lookups on an explicit mpu (DeepSpeed's deepspeed.utils.bwc) ------------------------
def _method(obj: Any, names: Sequence[str]) -> Callable[[], Any] | None:
    """``obj``'s first method among ``names`` (``None`` when ``obj`` is ``None`` or has none of them)."""
    return next((getattr(obj, n) for n in names if obj is not None and hasattr(obj, n)), None)


def _required_group(obj: Any, names: Sequence[str], what: str) -> ProcessGroup | None:
    if obj is None:
        return None
    method = _method(obj, names)
    if method is None:
        raise AttributeError(f"mpu {type(obj).__name__} has no {what} group: it defines none of {list(names)}")
    return method()


def bwc_tensor_model_parallel_rank(mpu: Any = None) -> int:
    """This rank's tensor-parallel rank from ``mpu`` (0 without one or without a tensor/slice/model API)."""
    method = _method(mpu, _TENSOR["rank"])
    return 0 if method is None else method()


def bwc_tensor_model_parallel_world_size(mpu: Any = None) -> int:
    """The tensor-parallel size from ``mpu`` (1 without one or without a tensor/slice/model API)."""
    method = _method(mpu, _TENSOR["world_size"])
    return 1 if method is None else method()


def bwc_tensor_model_parallel_group(mpu: Any = None) -> ProcessGroup | None:
    """The tensor-parallel group from ``mpu`` (``None`` without an mpu; AttributeError if it has no such API)."""
    return _required_group(mpu, _TENSOR["group"], "tensor-parallel")


def bwc_pipeline_parallel_world_size(mpu: Any = None) -> int:
    """The number of pipeline stages from ``mpu`` (1 without one or without a pipeline API)."""
    method = _method(mpu, _PIPE["world_size"])
    return 1 if method is None else method()


def bwc_pipeline_parallel_group(mpu: Any = None) -> ProcessGroup | None:
    """The pipeline group from ``mpu`` (``None`` without an mpu; AttributeError if it has no pipeline API)."""
    return _required_group(mpu, _PIPE["group"], "pipeline")


# ---- the registered mpu, or DeepSpeed's answer without one -------------------------------------------------------
def _require_dist() -> None:
    if not (torch_dist.is_available() and dist.is_initialized()):
        raise RuntimeError("deepspeed.utils.groups: torch.distributed is not initialised; call "
                           "deepspeed.init_distributed() (or deepspeed.initialize) before asking for process groups")


def _from_mpu(names: Sequence[str], fallback: Callable[[], Any]) -> Any:
    """The registered mpu's answer (its first method among ``names``), else ``fallback()``."""
    _require_dist()
    method = _method(registered_mpu(), names)
    return fallback() if method is None else method()


def _self_group() -> ProcessGroup:
    """A group of this rank alone, made once per default group; only this rank takes part in creating it."""
    global _SELF_GROUP
    world = torch_dist.group.WORLD
    if _SELF_GROUP is None or _SELF_GROUP[0] is not world:
        rank = torch_dist.get_rank()
        if torch_dist.get_backend() == "mpi":  # no group-local creation: every rank makes every singleton, in order
            group = [torch_dist.new_group([r]) for r in range(torch_dist.get_world_size())][rank]
        else:
            group = torch_dist.new_group([rank], use_local_synchronization=True)
        _SELF_GROUP = (world, group)
    return _SELF_GROUP[1]


def _get_data_parallel_group() -> ProcessGroup:
    """The data-parallel group: the mpu's, else the whole world."""
    return _from_mpu(("get_data_parallel_group",), lambda: torch_dist.group.WORLD)


def _get_data_parallel_world_size() -> int:
    return _from_mpu(("get_data_parallel_world_size",), lambda: torch_dist.get_world_size(_get_data_parallel_group()))


def _get_data_parallel_rank() -> int:
    return torch_dist.get_rank(group=_get_data_parallel_group())


def _get_data_parallel_group_ranks() -> list[int]:
    """The global ranks of this rank's data-parallel group."""
    return list(_from_mpu(("get_data_parallel_group_ranks",),
                          lambda: torch_dist.get_process_group_ranks(_get_data_parallel_group())))


def _get_model_parallel_group() -> ProcessGroup:
    """The mpu's model group (pipeline grid: this rank's whole replica), else this rank alone."""
    return _from_mpu(("get_model_parallel_group",), _self_group)


def _get_model_parallel_world_size() -> int:
    return _from_mpu(("get_model_parallel_world_size",), lambda: 1)


def _get_model_parallel_rank() -> int:
    return _from_mpu(("get_model_parallel_rank",), lambda: 0)


def _get_sequence_parallel_group() -> ProcessGroup:
    """The mpu's sequence-parallel group, else this rank alone."""
    return _from_mpu(("get_sequence_parallel_group",), _self_group)


def _get_sequence_parallel_world_size() -> int:
    return _from_mpu(("get_sequence_parallel_world_size",), lambda: 1)


def _get_sequence_parallel_rank() -> int:
    return _from_mpu(("get_sequence_parallel_rank",), lambda: 0)


def _get_sequence_data_parallel_group() -> ProcessGroup:
    """Data x sequence parallel (ZeRO partitioning and gradient reduction): the mpu's, else the data group."""
    return _from_mpu(("get_sequence_data_parallel_group",), _get_data_parallel_group)


def _get_sequence_data_parallel_world_size() -> int:
    return _from_mpu(("get_sequence_data_parallel_world_size",), _get_data_parallel_world_size)


def _get_sequence_data_parallel_rank() -> int:
    return _from_mpu(("get_sequence_data_parallel_rank",), _get_data_parallel_rank)


def _get_broadcast_src_rank() -> int:
    """The global rank of the first member of the sequence-data-parallel group (the source of broadcasts)."""
    return torch_dist.get_global_rank(_get_sequence_data_parallel_group(), 0)


# ---- explicit data x tensor groups (DeepSpeed's AutoTP mesh) ---------------------------------------------------
def _tp_dp_sizes(tensor_model_parallel_size: int, data_parallel_size: int | None) -> tuple[int, int]:
    world = dist.get_world_size()
    if tensor_model_parallel_size < 1 or world % tensor_model_parallel_size:
        raise ValueError(f"tensor_model_parallel_size={tensor_model_parallel_size}; accepted: a divisor of the world "
                         f"size ({world})")
    dp = world // tensor_model_parallel_size if data_parallel_size is None else data_parallel_size
    if dp * tensor_model_parallel_size != world:
        raise ValueError(f"data_parallel_size={data_parallel_size} x tensor_model_parallel_size="
                         f"{tensor_model_parallel_size} must equal the world size ({world})")
    return tensor_model_parallel_size, dp


def _set_tp_groups(data_group: Any, tensor_group: Any) -> tuple[Any, Any]:
    global _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP, _TP_GROUPS_OWNER
    _DATA_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP = data_group, tensor_group
    _MODEL_PARALLEL_GROUP = tensor_group
    _TP_GROUPS_OWNER = _default_group()
    return _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP


def _default_group() -> ProcessGroup | None:
    return torch_dist.group.WORLD if torch_dist.is_available() and torch_dist.is_initialized() else None


def _drop_stale_tp_groups() -> None:
    """Forget the data x tensor groups when the default process group they were made under is gone
    (``destroy_process_group``, perhaps followed by a new ``init_process_group`` in the same process): a destroyed
    group is never handed out, and the next ``_init_tp_mesh_device`` builds new groups instead of keeping them."""
    global _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP, _TP_GROUPS_OWNER
    if _TP_GROUPS_OWNER is not None and _TP_GROUPS_OWNER is not _default_group():
        _DATA_PARALLEL_GROUP = _MODEL_PARALLEL_GROUP = _TENSOR_MODEL_PARALLEL_GROUP = _TP_GROUPS_OWNER = None


def _init_tp_groups_with_new_group(tensor_model_parallel_size: int = 1,
                                   data_parallel_size: int | None = None) -> tuple[Any, Any]:
    """The data x tensor grid (tensor groups of consecutive ranks) from explicit rank lists: every rank creates
    every data group, then every tensor group, in order (``new_group`` is collective)."""
    tp, dp = _tp_dp_sizes(tensor_model_parallel_size, data_parallel_size)
    world, rank = dist.get_world_size(), dist.get_rank()
    data = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    tensor = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(dp)]
    return _set_tp_groups(data[rank % tp], tensor[rank // tp])


def _init_tp_mesh_device(tensor_model_parallel_size: int = 1,
                         data_parallel_size: int | None = None) -> tuple[Any, Any] | None:
    """Create the data x tensor groups once (a second call keeps the first ones and returns None): through a
    ``DeviceMesh`` of dims ("data_parallel", "tensor_parallel"), or from explicit rank lists where a mesh cannot
    be used (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, or a backend that cannot split groups). Returns (data, tensor)."""
    _drop_stale_tp_groups()
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return None
    tp, dp = _tp_dp_sizes(tensor_model_parallel_size, data_parallel_size)
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        log_dist("TORCH_DISTRIBUTED_DEBUG=DETAIL: tensor-parallel groups made with new_group", ranks=[0])
        return _init_tp_groups_with_new_group(tp, dp)
    try:
        mesh = _mesh_device((dp, tp), ("data_parallel", "tensor_parallel"))
    except RuntimeError as exc:
        if _DEVICE_MESH_SPLIT_UNSUPPORTED not in str(exc):
            raise
        log_dist("DeviceMesh cannot split this backend's groups: tensor-parallel groups made with new_group",
                 ranks=[0])
        return _init_tp_groups_with_new_group(tp, dp)
    return _set_tp_groups(mesh.get_group(mesh_dim="data_parallel"), mesh.get_group(mesh_dim="tensor_parallel"))


def _mesh_device(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """``deepspeed.comm.initialize_mesh_device`` where the comm layer offers it, else torch's ``init_device_mesh``
    on the accelerator's device type."""
    make = getattr(dist, "initialize_mesh_device", None)
    if make is not None:
        return make(shape, names)
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() and torch_dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, shape, mesh_dim_names=names)


# ---- the public tensor-parallel API --------------------------------------------------------------------------
def get_tensor_model_parallel_group() -> ProcessGroup:
    """The ``_init_tp_mesh_device`` tensor group, else the mpu's (tensor, else slice, else model API), else this
    rank alone."""
    _drop_stale_tp_groups()
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return _TENSOR_MODEL_PARALLEL_GROUP
    return _from_mpu(_TENSOR["group"], _self_group)


def get_model_parallel_group() -> ProcessGroup:
    """The ``_init_tp_mesh_device`` model group (the tensor group), else the tensor-parallel group."""
    _drop_stale_tp_groups()
    if _MODEL_PARALLEL_GROUP is not None:
        return _MODEL_PARALLEL_GROUP
    return get_tensor_model_parallel_group()


def get_data_parallel_group() -> ProcessGroup:
    """The ``_init_tp_mesh_device`` data group, else the mpu's, else the whole world."""
    _drop_stale_tp_groups()
    if _DATA_PARALLEL_GROUP is not None:
        return _DATA_PARALLEL_GROUP
    return _get_data_parallel_group()


def get_tensor_model_parallel_world_size() -> int:
    """The tensor-parallel size (a ``set_tensor_model_parallel_world_size`` value wins)."""
    if _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    _drop_stale_tp_groups()
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return torch_dist.get_world_size(_TENSOR_MODEL_PARALLEL_GROUP)
    return _from_mpu(_TENSOR["world_size"], lambda: 1)


def get_tensor_model_parallel_rank() -> int:
    """This rank's tensor-parallel rank (a ``set_tensor_model_parallel_rank`` value wins)."""
    if _MPU_TENSOR_MODEL_PARALLEL_RANK is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_RANK
    _drop_stale_tp_groups()
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return torch_dist.get_rank(_TENSOR_MODEL_PARALLEL_GROUP)
    return _from_mpu(_TENSOR["rank"], lambda: 0)


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of tensor-parallel rank 0 in this rank's tensor group."""
    return torch_dist.get_global_rank(get_tensor_model_parallel_group(), 0)


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    """Override the reported tensor-parallel size (``None`` clears it)."""
    global _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    """Override the reported tensor-parallel rank (``None`` clears it)."""
    global _MPU_TENSOR_MODEL_PARALLEL_RANK
    _MPU_TENSOR_MODEL_PARALLEL_RANK = rank


get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank


_EXPERT_NAMES = frozenset({
    "_create_expert_and_data_parallel", "_create_expert_data_and_model_parallel", "_get_expert_parallel_group",
    "_get_expert_parallel_group_ranks", "_get_expert_parallel_group_dict", "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_group_ranks", "_get_expert_data_parallel_group_dict",
    "_get_expert_parallel_world_size", "_get_expert_parallel_rank", "_get_expert_data_parallel_world_size",
    "_get_expert_data_parallel_rank", "_get_expert_parallel_src_rank", "_get_expert_broadcast_src_rank",
    "_get_expert_model_parallel_world_size", "_get_max_expert_size", "_get_max_expert_size_name",
    "_get_max_expert_parallel_group",
})


def __getattr__(name: str) -> Any:
    """The expert-group functions, from ``ds_moe.groups`` (imported on first use)."""
    if name in _EXPERT_NAMES:
        from ds_moe import groups as expert_groups

        return getattr(expert_groups, name)
    if name == "_get_expert_parallel_ranks":  # the pure rank arithmetic (E + M + D with an mpu)
        from ds_moe.rank_lists import expert_parallel_ranks_with_mpu

        return expert_parallel_ranks_with_mpu
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _GroupsModule(types.ModuleType):
    """``groups.mpu = grid`` (DeepSpeed clients' spelling) registers ``grid`` as ``register_mpu`` does, so it is owned
    by the world it is assigned in, even when the same object is assigned again in a later world."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "mpu":
            _MPU_OWNER[:] = [value, _default_group()]


sys.modules[__name__].__class__ = _GroupsModule
