"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: sequence-parallel groups as a module-level mpu.

``initialize_sequence_parallel(P)`` splits the world into blocks of ``P`` consecutive ranks, one sequence group
each, and puts every rank of a sequence-data-parallel block (all sequence groups of one data-parallel replica set:
here the whole world) into one sequence-data group. The module then answers the mpu questions the engine asks
(``get_sequence_parallel_group``, ``get_sequence_data_parallel_world_size``, ...), so scripts pass the module
itself as ``mpu``. As in DeepSpeed, its "model parallel" accessors name the sequence group (this mpu has no tensor
parallelism; a checkpoint's model-parallel rank is the sequence rank).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

_SEQUENCE_PARALLEL_GROUP: Any = None
_SEQUENCE_DATA_PARALLEL_GROUP: Any = None

__all__ = [
    "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
    "get_sequence_data_parallel_group", "get_sequence_data_parallel_rank", "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group", "get_sequence_parallel_rank", "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
]


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Create this process's sequence group (``sequence_parallel_size`` consecutive ranks) and its
    sequence-data-parallel group; collective: every rank calls it with the same size, once."""
    global _SEQUENCE_PARALLEL_GROUP, _SEQUENCE_DATA_PARALLEL_GROUP
    if not dist.is_initialized():
        raise RuntimeError("initialize_sequence_parallel: torch.distributed is not initialized; call "
                           "deepspeed.init_distributed() first")
    if _SEQUENCE_PARALLEL_GROUP is not None:
        raise RuntimeError("initialize_sequence_parallel: the sequence parallel groups are already initialized")
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(sequence_parallel_size, bool) or not isinstance(sequence_parallel_size, int) \
            or sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be an integer greater than 1, got {sequence_parallel_size!r}")
    if world % sequence_parallel_size:
        raise RuntimeError(f"sequence_parallel_size={sequence_parallel_size} must divide the world size ({world})")
    # new_group is collective: every rank creates every group, in the same order
    for start in range(0, world, sequence_parallel_size):
        ranks = list(range(start, start + sequence_parallel_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            _SEQUENCE_PARALLEL_GROUP = group
    # one sequence-data block spans sequence_parallel_size * (world // sequence_parallel_size) ranks: the world
    _SEQUENCE_DATA_PARALLEL_GROUP = dist.new_group(list(range(world)))


def _require(group: Any, what: str) -> Any:
    if group is None:
        raise RuntimeError(f"the {what} group is not initialized; call initialize_sequence_parallel(size) first")
    return group


def get_sequence_parallel_group() -> Any:
    return _require(_SEQUENCE_PARALLEL_GROUP, "sequence parallel")


def get_sequence_data_parallel_group() -> Any:
    return _require(_SEQUENCE_DATA_PARALLEL_GROUP, "sequence data parallel")


def get_sequence_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_parallel_group())


def get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_data_parallel_group())


def get_sequence_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_data_parallel_group())


get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
