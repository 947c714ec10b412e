"""``deepspeed.comm``: process-group setup and queries; the collectives live in ``_collectives``.

``init_distributed`` finds this rank's place (launcher variables, OpenMPI, MPICH, SLURM), picks the backend
from the accelerator (gloo on CPU, NCCL on CUDA) and initialises ``torch.distributed`` with a timeout that
every collective of the group then carries (``DEEPSPEED_TIMEOUT`` minutes, 30 by default).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional
from torch.distributed import ReduceOp, all_gather_object, broadcast_object_list, gather_object

from deepspeed.comm import _state
from deepspeed.comm._collectives import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    gather,
    inference_all_reduce,
    irecv,
    isend,
    monitored_barrier,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_fn,
    reduce_scatter_tensor,
    scatter,
    send,
)
from deepspeed.comm._env import LaunchEnv, discover_launch_env
from deepspeed.comm._exit import register_exit_hook
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT, default_pg_timeout
from deepspeed.utils.logging import logger


def _unpin_world_group() -> None:
    """``torch.distributed.nn.functional``'s collectives take ``group=group.WORLD`` as a default argument,
    evaluated when torch first imports the module (lazily, with the first optimizer). Imported while a process
    group exists, those defaults keep the group alive past ``destroy_process_group``: its gloo threads then
    outlive the interpreter and can abort the process at exit ("terminate called without an active
    exception"). ``None`` means the same default group and pins nothing. Imported here (above) it binds
    ``None`` when no group exists yet; this also covers a group made first (``PartialState``, a user's own
    ``init_process_group``)."""
    for fn in vars(torch.distributed.nn.functional).values():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


_unpin_world_group()
register_exit_hook()  # process groups end (their gloo threads joined) before the interpreter does; see _exit


comms_logger = _state.comms_logger

__all__ = [
    "ReduceOp", "TORCH_DISTRIBUTED_DEFAULT_PORT", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_reduce", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
    "broadcast_object_list",
    "comms_logger", "configure", "default_pg_timeout", "destroy_process_group", "gather", "gather_object",
    "get_all_ranks_from_group", "get_backend", "get_global_rank", "get_local_rank", "get_rank",
    "get_world_group", "get_world_size", "has_all_gather_into_tensor", "has_reduce_scatter_tensor",
    "inference_all_reduce", "init_distributed", "initialize_mesh_device", "irecv", "is_available",
    "is_initialized", "isend",
    "log_summary", "monitored_barrier", "new_group", "recv", "reduce", "reduce_scatter", "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "scatter", "send",
]


def _comms_section(config: Any):
    """The typed ``CommsLoggerConfig`` from a CommsLoggerConfig, a DeepSpeedConfig, or a config dict/path."""
    from ds_config import CommsLoggerConfig, DeepSpeedConfig, validate_section

    if isinstance(config, CommsLoggerConfig):
        return config
    if isinstance(config, DeepSpeedConfig):
        return config.comms_logger
    if isinstance(config, dict):
        return validate_section(CommsLoggerConfig, config.get("comms_logger"), path="comms_logger")
    if isinstance(config, (str, os.PathLike)):
        from ds_config import load_config

        return load_config(config).comms_logger
    raise TypeError(f"deepspeed.comm.configure: config must be a CommsLoggerConfig, DeepSpeedConfig, dict or path, "
                    f"got {type(config).__name__}")


def configure(deepspeed_config: Any = None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: list[str] | None = None, verbose: bool | None = None, debug: bool | None = None) -> None:
    """Set up the comms logger from the ``comms_logger`` section, then apply any explicit overrides."""
    logger_ = _state.comms_logger
    if deepspeed_config is not None:
        logger_.configure(_comms_section(deepspeed_config))
    overrides = {"enabled": enabled, "prof_all": prof_all, "verbose": verbose, "debug": debug}
    for key, value in overrides.items():
        if value is not None:
            setattr(logger_, key, bool(value))
    if prof_ops is not None:
        logger_.prof_ops = list(prof_ops)


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _check_backend(backend: str) -> str:
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("init_distributed: dist_backend='nccl' needs CUDA, which torch does not see; use 'gloo'")
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"init_distributed: dist_backend must be a backend name such as 'gloo' or 'nccl', "
                         f"got {backend!r}")
    return backend


def _resolve_placement(place: LaunchEnv, rank: int, world_size: int) -> LaunchEnv:
    """Explicit ``rank``/``world_size`` arguments override what the environment says."""
    if (rank >= 0) != (world_size > 0):
        raise ValueError(f"init_distributed: pass both rank and world_size or neither (got rank={rank}, "
                         f"world_size={world_size})")
    if rank >= 0 and rank >= world_size:
        raise ValueError(f"init_distributed: rank={rank} must be < world_size={world_size}")
    if rank < 0:
        return place
    return LaunchEnv(rank, world_size, place.local_rank, place.master_addr, place.master_port, place.source)


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True,
                     timeout: timedelta = default_pg_timeout, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialise ``torch.distributed`` for DeepSpeed (idempotent: an existing group is kept).

    ``dist_init_required=False`` only configures the comms logger (the caller owns the group, which must exist
    already, as DeepSpeed asserts); ``config`` (CommsLoggerConfig, DeepSpeedConfig, dict or path) configures the
    comms logger.
    """
    if config is not None:
        configure(config)
    if dist_init_required is None:
        dist_init_required = not is_initialized()
    if dist_init_required is False and not is_initialized():
        raise RuntimeError("init_distributed(dist_init_required=False): torch.distributed is not initialized; "
                           "call torch.distributed.init_process_group first, or pass dist_init_required=True "
                           "(or None) to let DeepSpeed initialize it")
    if not dist_init_required or is_initialized():
        if verbose and is_initialized() and dist.get_rank() == 0:
            logger.info("Distributed backend already initialized")
        return
    place = _resolve_placement(discover_launch_env(distributed_port, auto_mpi_discovery), rank, world_size)
    place.export()
    backend = _check_backend(dist_backend or _default_backend())
    if verbose and place.rank == 0:
        logger.info(f"Initializing TorchBackend in DeepSpeed with backend {backend} ({place.source}: "
                    f"world size {place.world_size}, master {place.master_addr}:{place.master_port})")
    if backend == "nccl":
        torch.cuda.set_device(place.local_rank)
    dist.init_process_group(backend, init_method=init_method or "env://", timeout=timeout, rank=place.rank,
                            world_size=place.world_size)


def _default_backend() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().communication_backend_name()


def destroy_process_group(group=None) -> None:
    dist.destroy_process_group(group)


def new_group(ranks: list[int] | None = None, timeout: timedelta | None = None, backend: str | None = None):
    """A subgroup of ``ranks`` (collective: every rank of the world must call it)."""
    return dist.new_group(ranks=ranks, timeout=timeout, backend=backend)


def get_rank(group=None) -> int:
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This rank's index on its node (``LOCAL_RANK``, exported by ``init_distributed``)."""
    if "LOCAL_RANK" not in os.environ:
        raise RuntimeError("get_local_rank: LOCAL_RANK is unset; call deepspeed.init_distributed() first")
    return int(os.environ["LOCAL_RANK"])


def get_global_rank(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group=None) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def get_world_group():
    return dist.group.WORLD


def initialize_mesh_device(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]):
    """A torch ``DeviceMesh`` of ``mesh_shape`` over the world, on the accelerator's device type (collective)."""
    if not dist.is_initialized():
        raise RuntimeError("initialize_mesh_device: torch.distributed is not initialized; call "
                           "deepspeed.init_distributed() first")
    from torch.distributed.device_mesh import init_device_mesh

    from deepspeed.accelerator import get_accelerator

    return init_device_mesh(get_accelerator().device_name(), tuple(mesh_shape), mesh_dim_names=tuple(mesh_dim_names))


def get_backend(group=None) -> str:
    return dist.get_backend(group)


def has_all_gather_into_tensor() -> bool:
    return hasattr(dist, "all_gather_into_tensor") or hasattr(dist, "all_gather_single")


def has_reduce_scatter_tensor() -> bool:
    return hasattr(dist, "reduce_scatter_tensor") or hasattr(dist, "reduce_scatter_single")


def _stragglers() -> dict[tuple[str, int], float]:
    """Per (op, size): this rank's total latency minus the fastest rank's (every rank must call this)."""
    rows = _state.comms_logger.rows()
    keys = [(op, size) for op, size, _ in rows]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, keys)
    if any(k != keys for k in everyone):
        raise RuntimeError("log_summary(show_straggler=True): ranks logged different operations; cannot compare")
    totals = torch.tensor([sum(rec.latencies_ms) for _, _, rec in rows], dtype=torch.float64)
    fastest = totals.clone()
    dist.all_reduce(fastest, op=ReduceOp.MIN)
    return {key: float(t - f) for key, t, f in zip(keys, totals.tolist(), fastest.tolist(), strict=True)}


def log_summary(show_straggler: bool = False) -> str:
    """Print the comms-logger table on rank 0 (collective: call it on every rank); return it (all ranks)."""
    if is_initialized():
        dist.barrier()
    stragglers = _stragglers() if show_straggler and is_initialized() else None
    table = _state.comms_logger.summary_table(stragglers)
    if not is_initialized() or dist.get_rank() == 0:
        print(table, flush=True)
    if is_initialized():
        dist.barrier()
    return table
