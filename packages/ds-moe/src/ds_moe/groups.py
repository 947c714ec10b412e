"""The expert-parallel and expert-data-parallel process groups, named ``ep_size_<n>``, as DeepSpeed keeps them.

DeepSpeed's API is module state (``deepspeed.utils.groups``): groups are created once per expert-parallel
size, on every rank in the same order, and looked up by name; ``deepspeed.utils.groups`` forwards its expert
functions here. Rank lists come from :mod:`ds_moe.rank_lists`. ``mpu`` (a Megatron-style model-parallel
unit, or None) is set by whoever owns the model-parallel layout; it decides the pipeline size and the
expert-tensor-parallel variant. Groups cached from a process group that has since been destroyed are
forgotten automatically (a new default group means new groups).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ds_moe.rank_lists import expert_and_data_parallel_ranks, expert_parallel_ranks_with_mpu

# Ours: what the AutoEP wiring (ds_moe.autoep) needs; the underscored names below are DeepSpeed's own spelling of
# its expert-group API (``deepspeed.utils.groups`` forwards them), public in spite of the underscore.
__all__ = [
    "expert_tensor_parallel_world_size",
    "mpu",
    "register_expert_groups",
    "require_initialized",
    "tensor_parallel_size",
    "_create_expert_and_data_parallel",
    "_create_expert_data_and_model_parallel",
    "_get_expert_broadcast_src_rank",
    "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_group_dict",
    "_get_expert_data_parallel_group_ranks",
    "_get_expert_data_parallel_rank",
    "_get_expert_data_parallel_world_size",
    "_get_expert_model_parallel_world_size",
    "_get_expert_parallel_group",
    "_get_expert_parallel_group_dict",
    "_get_expert_parallel_group_ranks",
    "_get_expert_parallel_rank",
    "_get_expert_parallel_src_rank",
    "_get_expert_parallel_world_size",
    "_get_max_expert_parallel_group",
    "_get_max_expert_size",
    "_get_max_expert_size_name",
]

mpu: Any = None  # Megatron-style model-parallel unit, set by the engine when the user passes one
expert_tensor_parallel_world_size = 1  # tensor-parallel degree of the experts themselves

_EXPERT_PARALLEL_GROUP: dict[str, dist.ProcessGroup] = {}
_EXPERT_PARALLEL_GROUP_RANKS: dict[str, list[int]] = {}
_EXPERT_DATA_PARALLEL_GROUP: dict[str, dist.ProcessGroup] = {}
_EXPERT_DATA_PARALLEL_GROUP_RANKS: dict[str, list[int]] = {}
_OWNER: list[Any] = [None]  # the default process group the cached groups were created under


def _reset_expert_groups() -> None:
    """Forget every cached expert group (the process groups themselves are left to torch)."""
    global expert_tensor_parallel_world_size
    for table in (_EXPERT_PARALLEL_GROUP, _EXPERT_PARALLEL_GROUP_RANKS, _EXPERT_DATA_PARALLEL_GROUP,
                  _EXPERT_DATA_PARALLEL_GROUP_RANKS):
        table.clear()
    expert_tensor_parallel_world_size = 1


def _sync_with_default_group() -> None:
    current = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if current is not _OWNER[0]:
        _reset_expert_groups()
        _OWNER[0] = current


def require_initialized() -> None:
    """Raise unless torch.distributed is initialised; forget groups cached under an earlier default group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("expert process groups need torch.distributed: call init_process_group first")
    _sync_with_default_group()


def _mpu_size(unit: Any, *getters: str) -> int:
    for getter in getters:
        if unit is not None and hasattr(unit, getter):
            return int(getattr(unit, getter)())
    return 1


def _pipeline_size(unit: Any) -> int:
    return _mpu_size(unit, "get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")


def tensor_parallel_size(unit: Any) -> int:
    """The tensor-parallel size of a Megatron-style ``mpu`` (1 for ``None`` or one without a tensor API)."""
    return _mpu_size(unit, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")


def register_expert_groups(name: str, ep_groups: list[list[int]], edp_groups: list[list[int]], edp_first: bool) -> None:
    """``new_group`` for every listed group (all ranks, same order); keep the ones holding this rank (under
    ``name``; a table that already holds ``name`` is left as it is)."""
    require_initialized()
    rank = dist.get_rank()
    tables = [(ep_groups, _EXPERT_PARALLEL_GROUP, _EXPERT_PARALLEL_GROUP_RANKS),
              (edp_groups, _EXPERT_DATA_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_GROUP_RANKS)]
    for lists, groups, ranks_of in (tables[::-1] if edp_first else tables):
        if name in groups:
            continue
        for ranks in lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                groups[name], ranks_of[name] = group, list(ranks)


def _create_expert_and_data_parallel(expert_parallel_size_: int, mp_size: int | None = None,
                                     pp_size: int | None = None, mp_mode: str = "tp",
                                     use_data_before_expert_parallel_: bool = False) -> None:
    """Create the ``ep_size_<n>`` groups (no-op for the ones that exist). ``pp_size`` None: from ``mpu``."""
    require_initialized()
    ep_groups, edp_groups = expert_and_data_parallel_ranks(
        dist.get_world_size(), expert_parallel_size_, _pipeline_size(mpu) if pp_size is None else pp_size,
        1 if mp_size is None else mp_size, mp_mode, use_data_before_expert_parallel_)
    register_expert_groups(f"ep_size_{expert_parallel_size_}", ep_groups, edp_groups, edp_first=(mp_size or 1) <= 1)


def _create_expert_data_and_model_parallel(expert_parallel_size_: int, mpu: Any,
                                           use_data_before_expert_parallel_: bool = False) -> None:
    """Create the ``ep_size_<n>`` groups for experts that are themselves tensor-parallel over ``mpu``."""
    global expert_tensor_parallel_world_size
    require_initialized()
    tp, pp, world = tensor_parallel_size(mpu), _pipeline_size(mpu), dist.get_world_size()
    ep_groups, edp_groups = expert_parallel_ranks_with_mpu(world, tp, expert_parallel_size_, pp,
                                                           use_data_before_expert_parallel_)
    expert_tensor_parallel_world_size = tp
    name = f"ep_size_{expert_parallel_size_}"
    if name not in _EXPERT_PARALLEL_GROUP and name not in _EXPERT_DATA_PARALLEL_GROUP:
        register_expert_groups(name, ep_groups, edp_groups, edp_first=False)


def _lookup(table: dict, name: str, what: str) -> Any:
    _sync_with_default_group()
    if name not in table:
        raise RuntimeError(f"{what} group {name!r} is not initialized (known: {sorted(table)}); create it with "
                           "MoE.set_deepspeed_parallelism() or _create_expert_and_data_parallel()")
    return table[name]


def _get_expert_parallel_group(group_name: str) -> dist.ProcessGroup:
    return _lookup(_EXPERT_PARALLEL_GROUP, group_name, "expert parallel")


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return _lookup(_EXPERT_PARALLEL_GROUP_RANKS, group_name, "expert parallel")


def _get_expert_parallel_group_dict() -> dict[str, dist.ProcessGroup]:
    _sync_with_default_group()
    return _EXPERT_PARALLEL_GROUP


def _get_expert_data_parallel_group(group_name: str) -> dist.ProcessGroup:
    return _lookup(_EXPERT_DATA_PARALLEL_GROUP, group_name, "expert data parallel")


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return _lookup(_EXPERT_DATA_PARALLEL_GROUP_RANKS, group_name, "expert data parallel")


def _get_expert_data_parallel_group_dict() -> dict[str, dist.ProcessGroup]:
    _sync_with_default_group()
    return _EXPERT_DATA_PARALLEL_GROUP


def _get_expert_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(group=_get_expert_parallel_group(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    return dist.get_rank(group=_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(group=_get_expert_data_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return dist.get_rank(group=_get_expert_data_parallel_group(group_name))


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """DeepSpeed's formula: the global rank rounded down to a multiple of the EP world size."""
    size = _get_expert_parallel_world_size(group_name)
    return (dist.get_rank() // size) * size


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """Global rank of the first member of this rank's expert-data-parallel group."""
    return _get_expert_data_parallel_group_ranks(group_name)[0]


def _get_expert_model_parallel_world_size() -> int:
    return expert_tensor_parallel_world_size


def _get_max_expert_size() -> int | None:
    """The largest ``ep_size`` among the created groups (None when there are none)."""
    sizes = [int(name.split("_")[2]) for name in _get_expert_parallel_group_dict()]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> dist.ProcessGroup:
    return _get_expert_parallel_group(_get_max_expert_size_name())
