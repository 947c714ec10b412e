"""AutoSP's device mesh: sequence-parallel groups of consecutive ranks, one per data-parallel index.

With ``SP`` ranks per sequence group and ``DP`` groups, group ``g`` holds ranks ``[g*SP, (g+1)*SP)`` (the layout
DeepSpeed's engine gives its sequence groups), so rank ``r`` belongs to group ``r // SP`` at position ``r % SP``.
``populate_registry`` creates the groups once per process (``new_group`` is collective: every rank creates every
group); later calls keep the first mesh. Graph passes read ``sp_size()`` while rewriting a graph.
"""

from __future__ import annotations

from typing import Any

import deepspeed.comm as dist

GROUP_REGISTRY: dict[Any, Any] = {}
"""Group index (int) -> process group, plus ``"SP_SIZE"``, ``"DP_SIZE"`` and ``"is_reg"`` once populated."""


def register_groups(groups: list[list[int]]) -> None:
    """Create one process group per rank list (``[[0, 1], [2, 3]]``) under its index, skipping indices already
    registered."""
    for index, ranks in enumerate(groups):
        if index not in GROUP_REGISTRY:
            GROUP_REGISTRY[index] = dist.new_group(ranks)


def get_group(gid: int | None) -> Any:
    """The sequence group of index ``gid`` (``rank // sp_size()``); ``None``: the world group."""
    if gid is None:
        return dist.get_world_group()
    if gid not in GROUP_REGISTRY:
        known = sorted(k for k in GROUP_REGISTRY if isinstance(k, int))
        raise KeyError(f"AutoSP: no sequence-parallel group {gid!r} registered (registered: {known}); call "
                       "populate_registry(sp_size, dp_size) first")
    return GROUP_REGISTRY[gid]


def get_registry() -> dict[Any, Any]:
    return GROUP_REGISTRY


def is_setup() -> bool:
    """Whether ``populate_registry`` has built the mesh."""
    return bool(GROUP_REGISTRY.get("is_reg", False))


def extract_mesh_size(param_dict: dict[str, Any]) -> tuple[int, int]:
    """``(sp_size, dp_size)`` of a DeepSpeed config dict: ``sequence_parallel_size`` (default 1) and the world size
    divided by it."""
    sp = param_dict.get("sequence_parallel_size", 1)
    world = dist.get_world_size()
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1 or world % sp:
        raise ValueError(f"AutoSP: sequence_parallel_size={sp!r} must be a positive integer dividing the world size "
                         f"({world})")
    return sp, world // sp


def _registered(key: str) -> int:
    if key not in GROUP_REGISTRY:
        raise RuntimeError(f"AutoSP: the sequence/data-parallel mesh is not set up ({key} unknown); call "
                           "populate_registry(sp_size, dp_size) first")
    return GROUP_REGISTRY[key]


def sp_size() -> int:
    """Ranks per sequence-parallel group."""
    return _registered("SP_SIZE")


def dp_size() -> int:
    """Number of sequence-parallel groups (the data-parallel degree)."""
    return _registered("DP_SIZE")


def populate_registry(SP_SIZE: int, DP_SIZE: int) -> None:  # noqa: N803 (DeepSpeed's argument names)
    """Build the mesh of ``DP_SIZE`` groups of ``SP_SIZE`` consecutive ranks (no-op once built)."""
    if is_setup():
        return
    for name, value in (("SP_SIZE", SP_SIZE), ("DP_SIZE", DP_SIZE)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"populate_registry: {name} must be a positive integer, got {value!r}")
    if SP_SIZE * DP_SIZE > dist.get_world_size():
        raise ValueError(f"populate_registry: SP_SIZE * DP_SIZE = {SP_SIZE * DP_SIZE} exceeds the world size "
                         f"({dist.get_world_size()})")
    register_groups([list(range(g * SP_SIZE, (g + 1) * SP_SIZE)) for g in range(DP_SIZE)])
    GROUP_REGISTRY.update(SP_SIZE=SP_SIZE, DP_SIZE=DP_SIZE, is_reg=True)
