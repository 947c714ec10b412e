"""Parameters partitioned over a group other than the data-parallel one (AutoEP experts under ZeRO-3).

An expert-parallel rank holds only its own experts, and the ranks holding the same experts form that expert's
expert-data-parallel group. So an expert parameter is partitioned over its expert-data-parallel group (each
element lives on exactly one rank of the world, as every other parameter's does over the data-parallel group),
its gradients are reduce-scattered within that group, and the average still divides by the data-parallel size:
the experts see every token of the global batch, as the dense weights do.

The interface is typed and narrow: the caller (the engine, which knows the expert groups) names each placement
as a :class:`PartitionGroup`; parameters carry DeepSpeed's ``ds_zero_placement_family`` /
``ds_zero_partition_group_name`` marks (set by the AutoEP layer). Everything downstream reads the partition
group a parameter lives in from its own ``ds_space``: the gathers (grouped by ``ds_space.group``), the optimizer's
sub-groups (one partition group each), the reduce-scatter (one per partition group, :class:`GroupedReduceScatter`)
and the checkpoint (each rank's own partitions). The global gradient norm needs nothing more: summing every
rank's partitions' squares over the data-parallel group counts each element once, experts included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_zero.stage_1_and_2 import ReduceSettings
from ds_zero.zero3._reduce_scatter import ReduceScatter
from ds_zero.zero3.param import PartitionSpace

EXPERT_FAMILY = "autoep_expert"  # DeepSpeed's ds_zero_placement_family values
REPLICATED_FAMILY = "replicated"


@dataclass(frozen=True)
class PartitionGroup:
    """A named placement: parameters whose ``ds_zero_partition_group_name`` is ``name`` are partitioned over
    ``group`` (e.g. ``"ep_size_2"`` -> that expert group's expert-data-parallel group)."""

    name: str
    group: Any


def placement_name(param: torch.nn.Parameter) -> str | None:
    """The partition group ``param`` asks for (None: the data-parallel group)."""
    if getattr(param, "ds_zero_placement_family", None) != EXPERT_FAMILY:
        return None
    return getattr(param, "ds_zero_partition_group_name", None)


class PartitionSpaces:
    """One :class:`PartitionSpace` per placement, built once so parameters of one placement share the same space
    object (and so the same group in every gather and reduce-scatter)."""

    def __init__(self, default: PartitionSpace, placements: Sequence[PartitionGroup] = ()) -> None:
        self.default = default
        self.by_name: dict[str, PartitionSpace] = {}
        for placement in placements:
            self.by_name[placement.name] = PartitionSpace.of(
                placement.group, default.device, default.compute_device, comm=default.comm,
                fetch_all_reduce=default.fetch_all_reduce, sequential=default.sequential)

    def space_for(self, param: torch.nn.Parameter) -> PartitionSpace:
        name = placement_name(param)
        if name is None:
            return self.default
        space = self.by_name.get(name)
        if space is None:
            raise ValueError(f"ZeRO-3: a parameter (shape {tuple(param.shape)}) is marked for partition group "
                             f"{name!r}, but the engine has no such group (known: {sorted(self.by_name)})")
        return space


def split_by_space(params: Sequence[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """``params`` cut into runs of one partition group each (model order kept within a run)."""
    runs: dict[int, list[torch.nn.Parameter]] = {}
    for p in params:
        runs.setdefault(id(p.ds_space.group), []).append(p)
    return list(runs.values())


class GroupedReduceScatter:
    """The engine's gradient reducer when parameters live in several partition groups: one
    :class:`ReduceScatter` per group, each averaging over ``average_over`` (the data-parallel size). Every rank
    builds the parts in the same order (dense parameters first), and ``finish`` drains them in that order."""

    every_micro_step = True
    reduced = True

    def __init__(self, parts: Sequence[ReduceScatter], end_pass: Callable[[], None]) -> None:
        self.parts = list(parts)
        self.end_pass = end_pass
        self.owner = {id(p): part for part in self.parts for bucket in part.buckets for p in bucket.params}
        self.world = self.parts[0].world  # the data-parallel partition group's size (ZeRO++ checks it)

    @property
    def micro_steps(self) -> int:
        return self.parts[0].micro_steps

    @property
    def coalescing(self) -> bool:
        return self.parts[0].coalescing

    @property
    def add_to_partition(self) -> Callable:
        return self.parts[0].add_to_partition

    @add_to_partition.setter
    def add_to_partition(self, fn: Callable) -> None:
        for part in self.parts:
            part.add_to_partition = fn

    def configure_zeropp(self, replica: Any = None, qgz: Any = None) -> None:
        if replica is not None or qgz is not None:
            raise ValueError("ZeRO-3 with AutoEP experts: MiCS and qgZ (zero_quantized_gradients) reduce over the "
                             "data-parallel group only; turn them off (mics_shard_size -1, "
                             "zero_quantized_gradients false)")

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        part = self.owner.get(id(param))
        if part is not None:
            part.grad_ready(param)

    def finish(self) -> None:
        for part in self.parts:
            part.finish()
        self.end_pass()

    def reset(self) -> None:
        for part in self.parts:
            part.reset()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.hold())
            yield

    @contextlib.contextmanager
    def coalesce(self) -> Iterator[None]:
        with self.hold():
            yield
        self.finish()

    def buffers(self) -> list[torch.Tensor]:
        return [b for part in self.parts for b in part.buffers()]


def build_reducer(params: Sequence[torch.nn.Parameter], add_to_partition: Callable, settings: ReduceSettings,
                  comm: Any, dp_group: Any, dp_world: int, dp_rank: int, comm_dtype: torch.dtype,
                  end_pass: Callable[[], None]) -> ReduceScatter | GroupedReduceScatter:
    """The ZeRO-3 reduce-scatter over ``params``: a plain :class:`ReduceScatter` over the data-parallel group when
    every parameter is partitioned over it, else one per partition group (gradients averaged over ``dp_world``)."""
    dense = [p for p in params if placement_name(p) is None]
    others = split_by_space([p for p in params if placement_name(p) is not None])
    if not others:
        return ReduceScatter(list(params), add_to_partition, settings, comm, dp_group, dp_world, dp_rank, comm_dtype,
                             end_pass)

    def part(members: list[torch.nn.Parameter], group: Any, world: int, rank: int) -> ReduceScatter:
        return ReduceScatter(members, add_to_partition, settings, comm, group, world, rank, comm_dtype,
                             lambda: None, average_over=dp_world)

    parts = [part(dense, dp_group, dp_world, dp_rank)]
    for members in sorted(others, key=lambda run: placement_name(run[0]) or ""):
        space = members[0].ds_space
        parts.append(part(members, space.group, space.world, space.rank))
    return GroupedReduceScatter(parts, end_pass)


def partition_group_metadata(sub_groups: Sequence[Sequence[torch.nn.Parameter]],
                             count: Callable[[int], int], rank: Callable[[int], int],
                             ranks: Callable[[int], list[int]]) -> list[dict[str, Any]] | None:
    """DeepSpeed's ``_zero3_partition_group_metadata``: per sub-group holding parameters partitioned over a named
    group, its partition count, this rank's place and the global ranks of the group, and the placement families
    and group names of its parameters; None when every parameter is partitioned over the data-parallel group."""
    out = []
    for i, params in enumerate(sub_groups):
        names = sorted({placement_name(p) for p in params if placement_name(p) is not None})
        if not names:
            continue
        families = sorted({str(getattr(p, "ds_zero_placement_family", REPLICATED_FAMILY)) for p in params})
        out.append({"sub_group": i, "partition_count": int(count(i)), "partition_rank": int(rank(i)),
                    "partition_ranks": [int(r) for r in ranks(i)], "families": families, "group_names": names})
    return out or None


def mark_partition_world(params: Mapping[str, torch.nn.Parameter] | Sequence[torch.nn.Parameter]) -> None:
    """DeepSpeed's per-parameter placement attributes after partitioning: the size and group each parameter is
    partitioned over (``ds_zero_partition_world_size``, ``ds_zero_partition_process_group``)."""
    for p in (params.values() if isinstance(params, Mapping) else params):
        space = getattr(p, "ds_space", None)
        if space is None:
            continue
        p.ds_zero_partition_world_size = space.world
        p.ds_zero_partition_process_group = space.group


class PartitionGroupQueries:
    """The ZeRO-3 optimizer's questions about the partition group of a parameter or sub-group (DeepSpeed's names);
    a mixin of ``DeepSpeedZeroOptimizer_Stage3``, reading its ``groups`` (each one partition group) and
    ``dp_group``."""

    groups: list[Any]
    dp_group: Any
    fp16_groups: list[list[torch.nn.Parameter]]

    def _get_param_partition_group(self, param: torch.nn.Parameter) -> Any:
        return param.ds_space.group

    def _get_sub_group_partition_count(self, i: int) -> int:
        return self.groups[i].layout.world

    def _get_sub_group_partition_rank(self, i: int) -> int:
        return self.groups[i].rank

    def _get_sub_group_partition_ranks(self, i: int) -> list[int]:
        params = self.groups[i].params
        group = params[0].ds_space.group if params else self.dp_group
        if not (dist.is_available() and dist.is_initialized()):
            return [0]
        return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))

    def _zero3_partition_group_metadata(self) -> list[dict[str, Any]] | None:
        """Per sub-group over a named partition group (AutoEP experts): its partition count, rank and ranks, for
        the checkpoint (None when every parameter is partitioned over the data-parallel group)."""
        return partition_group_metadata(self.fp16_groups, self._get_sub_group_partition_count,
                                        self._get_sub_group_partition_rank, self._get_sub_group_partition_ranks)
