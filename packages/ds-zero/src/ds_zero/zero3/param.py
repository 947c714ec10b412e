"""The state of one ZeRO-3 partitioned parameter: its ``ds_*`` attributes, its local partition, and the
functions that fill (gather) and empty (release) its full value.

Every parameter is partitioned on its own, as DeepSpeed does: the flattened value is padded with zeros to a
multiple of the data-parallel world size ``W`` and rank ``r`` keeps elements ``[r*P, (r+1)*P)`` in
``param.ds_tensor`` (``P = ceil(numel / W)``, in the training dtype, on the device of the partitions: the
accelerator, or the CPU with ``offload_param`` / ``remote_device="cpu"``). While released, ``param.data`` is an
empty tensor of the parameter's dtype; while gathered it holds the whole value, and ``ds_status`` says which.
Turning a whole parameter into a partitioned one is ``convert``; the collectives that move the values live in
``_collectives``; the scheduling (which module gathers what, and when) in ``schedule``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from ds_zero.collectives import TORCH
from ds_zero.zero3.gather_pool import give as give_full


class ZeroParamStatus(Enum):
    """DeepSpeed's ``ds_status`` values."""

    AVAILABLE = 1  # the whole value is in param.data
    NOT_AVAILABLE = 2  # only the partition exists; param.data is empty
    INFLIGHT = 3  # a gather is on its way


@dataclass(frozen=True)
class PartitionSpace:
    """Where partitions live: the data-parallel ``group`` (None: the world), this ``rank`` of ``world`` ranks,
    the ``device`` partitions are stored on, and the ``compute_device`` gathered values are built on."""

    group: Any
    world: int
    rank: int
    device: torch.device
    compute_device: torch.device
    comm: Any = TORCH
    fetch_all_reduce: bool = False  # stage3_use_all_reduce_for_fetch_params
    sequential: bool = False  # stage3_allgather_sequential: one exchange per parameter

    @classmethod
    def of(cls, group: Any, device: Any, compute_device: Any, comm: Any = TORCH, fetch_all_reduce: bool = False,
           sequential: bool = False) -> PartitionSpace:
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size(group) if distributed else 1
        rank = dist.get_rank(group) if distributed else 0
        return cls(group, world, rank, torch.device(device), torch.device(compute_device), comm, fetch_all_reduce,
                   sequential)


def partition_numel(numel: int, world: int) -> int:
    """Elements per rank of a parameter of ``numel`` elements: ``ceil(numel / world)``."""
    return math.ceil(numel / world) if numel else 0


def is_partitioned(param: Any) -> bool:
    return hasattr(param, "ds_id")


def _empty_like(param: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=param.dtype, device=param.device)


def install_full(param: torch.nn.Parameter, full: torch.Tensor, base: torch.Tensor | None = None) -> None:
    """Make ``full`` (``ds_numel`` elements, any layout) the parameter's whole value; ``base``: the pooled buffer
    ``full`` lives in (``gather_pool``), given back when the value is released or replaced."""
    old = param.__dict__.get("ds_full_base")
    param.data = full.view(param.ds_shape)
    param.ds_full_base = base
    param.ds_status = ZeroParamStatus.AVAILABLE
    if old is not None:
        give_full(old)


def release_one(param: torch.nn.Parameter, include_persistent: bool = False) -> None:
    if param.ds_status is ZeroParamStatus.AVAILABLE and (include_persistent or not param.ds_persist):
        param.data = _empty_like(param.data)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        base = param.__dict__.get("ds_full_base")
        if base is not None:
            param.ds_full_base = None
            give_full(base)


def write_partition_from_full(param: torch.nn.Parameter, full: torch.Tensor) -> None:
    """Copy this rank's slice of ``full`` (the whole value, any shape with ``ds_numel`` elements) into
    ``ds_tensor`` (or, for a partition on NVMe, into its swap file)."""
    space = param.ds_space
    part = param.ds_tensor.numel()
    flat = full.reshape(-1)
    start = min(space.rank * part, flat.numel())
    end = min(start + part, flat.numel())
    with torch.no_grad():
        if _swapper(param) is not None:
            value = torch.zeros(part, dtype=param.ds_tensor.dtype)
            value[:end - start].copy_(flat[start:end])
            param.ds_swapper.write(param, value)
            return
        param.ds_tensor.zero_()
        param.ds_tensor[:end - start].copy_(flat[start:end])


def _swapper(param: Any) -> Any:
    return getattr(param, "ds_swapper", None)


def _by_swapper(params: list[torch.nn.Parameter]) -> dict[Any, list[torch.nn.Parameter]]:
    out: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:
        swapper = _swapper(p)
        if swapper is not None:
            out.setdefault(swapper, []).append(p)
    return out


def swap_in_partitions(params: list[torch.nn.Parameter]) -> None:
    """Partitions on NVMe (ZeRO-Infinity) become resident ``ds_tensor`` values, for a gather to read."""
    for swapper, ps in _by_swapper(params).items():
        swapper.swap_in(ps)


def release_partitions(params: list[torch.nn.Parameter]) -> None:
    """The gather that needed them is done: resident NVMe partitions go back to their files only."""
    for swapper, ps in _by_swapper(params).items():
        swapper.release(ps)


def prefetch_partitions(params: list[torch.nn.Parameter]) -> None:
    """Start reading NVMe partitions that will be gathered soon (as far as the swap buffers allow)."""
    for swapper, ps in _by_swapper(params).items():
        swapper.prefetch(ps)


def partition_copy(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's partition in new memory, wherever it lives (its device, or the CPU when it is on NVMe)."""
    swapper = _swapper(param)
    return swapper.read_copy(param) if swapper is not None else param.ds_tensor.detach().clone()


def full_from_pieces(pieces: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """The whole value from ``pieces`` (``[world, P]``: every rank's partition in rank order)."""
    return pieces.reshape(-1)[:param.ds_numel]


def retarget_partition(param: torch.nn.Parameter, device: torch.device, dtype: torch.dtype) -> None:
    """Move/cast the partition (``zero.Init`` built it for another device or dtype); one on NVMe stays on NVMe
    and is rewritten in ``dtype``."""
    swapper = _swapper(param)
    if swapper is not None:
        if param.ds_tensor.dtype != dtype:
            swapper.convert(param, dtype)
        return
    param.ds_tensor = param.ds_tensor.to(device, dtype)
    param.ds_tensor.ds_numel = param.ds_tensor.numel()
