"""The global L2 gradient norm, shared by every optimizer wrapper (stage 0 and ZeRO stages 1-3).

Data parallelism: gradients partitioned across the data-parallel group (ZeRO) are summed as squares over
that group (one scalar all-reduce). Model parallelism (pipeline stages, tensor slices): each rank holds only
some parameters, so the squares are also summed over the model-parallel group, and a parameter whose
gradient another rank already counts is left out (DeepSpeed's ``get_grad_norm`` / ``get_grad_norm_direct``
rule, :func:`counts_in_norm`). inf/nan on any rank makes the norm inf/nan on every rank of both groups, so
that is the overflow verdict too; a parameter left out of the norm still makes it nan when it overflows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_zero.collectives import TORCH, Collectives
from ds_zero.partition import Fragment

PIPE_REPLICATED = "ds_pipe_replicated"  # set by ds_pipe.PipelineModule on a tied weight's non-owner copies


@dataclass(frozen=True, eq=False)
class NormScope:
    """Where a gradient norm is summed beyond the data-parallel group: the model-parallel ``group`` (all
    pipeline stages and tensor slices of one data-parallel replica) of ``world_size`` ranks, and this rank's
    tensor-model-parallel rank (which decides whether replicated, non-sliced parameters count here)."""

    group: Any = None
    world_size: int = 1
    tensor_mp_rank: int = 0

    @property
    def spans_ranks(self) -> bool:
        """True when the norm needs a model-parallel all-reduce."""
        return self.world_size > 1


LOCAL = NormScope()
"""No model parallelism: the norm is this rank's (or the data-parallel group's) alone."""


def tensor_model_parallel_rank(mpu: Any) -> int:
    """DeepSpeed's ``bwc_tensor_model_parallel_rank``: the tensor-slice rank of an mpu (0 without one)."""
    if mpu is None:
        return 0
    for name in ("get_tensor_model_parallel_rank", "get_slice_parallel_rank", "get_model_parallel_rank"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    raise TypeError(f"mpu {type(mpu).__name__} has none of get_tensor_model_parallel_rank(), "
                    "get_slice_parallel_rank(), get_model_parallel_rank(): cannot tell which parameters count in "
                    "the gradient norm")


def norm_scope(mpu: Any) -> NormScope:
    """The scope of an mpu (anything with ``get_model_parallel_group()``, e.g. ``PipelineParallelGrid``);
    ``LOCAL`` for None."""
    if mpu is None:
        return LOCAL
    if not hasattr(mpu, "get_model_parallel_group"):
        raise TypeError(f"mpu {type(mpu).__name__} has no get_model_parallel_group(): gradient clipping and "
                        "overflow checks sum the gradient norm over the model-parallel group, so the mpu must "
                        "provide it")
    group = mpu.get_model_parallel_group()
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    return NormScope(group=group, world_size=world, tensor_mp_rank=tensor_model_parallel_rank(mpu))


def is_model_parallel_parameter(param: torch.Tensor) -> bool:
    """DeepSpeed's test: a parameter sliced across tensor-parallel ranks (each rank holds a different part)."""
    return bool(getattr(param, "model_parallel", False) or getattr(param, "tensor_model_parallel", False))


def counts_in_norm(param: torch.Tensor, scope: NormScope) -> bool:
    """Whether this rank counts ``param`` in the global norm: not a tied weight's copy on a non-owner stage,
    and, on tensor-slice ranks > 0, only sliced parameters (replicated ones are counted by slice rank 0)."""
    if getattr(param, PIPE_REPLICATED, False):
        return False
    return scope.tensor_mp_rank == 0 or is_model_parallel_parameter(param)


def _sum_of_squares(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    sumsq = torch.zeros((), dtype=torch.float32, device=device)
    for t in tensors:
        if t.numel():
            sumsq += torch.linalg.vector_norm(t, 2.0, dtype=torch.float32).to(device) ** 2
    return sumsq


def _sum_over(total: torch.Tensor, comm: Collectives, group: Any) -> torch.Tensor:
    if dist.get_backend(group) == "nccl" and total.device.type == "cpu":
        total = total.cuda()
    comm.all_reduce(total, group=group)
    return total


def _overflow_marker(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0 when every element of ``tensors`` is finite, else nan (``norm * 0``): added to a sum of squares so
    gradients left out of the norm still make it an overflow, without a host sync."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = [torch.linalg.vector_norm(t, 2.0, dtype=torch.float32).to(device) for t in tensors if t.numel()]
    return torch.stack(norms).sum() * 0.0 if norms else torch.zeros((), dtype=torch.float32, device=device)


def partitioned_norm(grads: list[torch.Tensor], comm: Any, group: Any, world: int, scope: NormScope = LOCAL,
                     uncounted: Sequence[torch.Tensor] = ()) -> float:
    """The global norm of ``grads`` (this rank's counted pieces, partitioned over ``group`` of ``world`` ranks),
    summed over ``scope``'s model-parallel group too; ``uncounted`` pieces only feed the overflow verdict."""
    device = grads[0].device if grads else (uncounted[0].device if uncounted else torch.device("cpu"))
    sumsq = _sum_of_squares(grads, device)
    if uncounted:
        sumsq += _overflow_marker(uncounted, device)
    if world > 1:
        sumsq = _sum_over(sumsq, comm, group)
    if scope.spans_ranks:  # after the data-parallel sum, as DeepSpeed: each replica's stages hold disjoint sums
        sumsq = _sum_over(sumsq, comm, scope.group)
    return math.sqrt(float(sumsq))


def model_parallel_norm(local_norm: float, scope: NormScope, comm: Collectives = TORCH) -> float:
    """The norm over ``scope``'s model-parallel group from this rank's ``local_norm`` (of full, data-parallel
    averaged gradients: stage 0); ``local_norm`` itself when the scope is one rank (no collective)."""
    if not scope.spans_ranks:
        return local_norm
    sumsq = torch.tensor(local_norm * local_norm, dtype=torch.float64)  # fp64: the square of an fp32 norm is exact
    return math.sqrt(float(_sum_over(sumsq, comm, scope.group)))


def partition_runs(fragments: Sequence[Fragment], counts: Sequence[bool]) -> tuple[list[tuple[int, int]],
                                                                                 list[tuple[int, int]]]:
    """Split a partition's ``fragments`` (of tensors whose ``counts[index]`` says whether they count in the
    norm) into ``(offset, numel)`` runs in the partition, contiguous runs merged: ``(counted, left out)``.
    The partition's zero padding is in neither (it adds nothing to a norm)."""
    runs: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
    for frag in fragments:
        out = runs[0] if counts[frag.index] else runs[1]
        if out and out[-1][0] + out[-1][1] == frag.partition_offset:
            out[-1] = (out[-1][0], out[-1][1] + frag.numel)
        else:
            out.append((frag.partition_offset, frag.numel))
    return runs
