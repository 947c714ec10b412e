"""The process grid: named axes (pipe, data, model, ...) mapped row-major onto global ranks.

``ProcessTopology`` and its two named subclasses are pure (no process group needed). ``PipelineParallelGrid``
is the mpu-style object that creates the process groups of a topology once, with ``torch.distributed``.
Semantics follow ``deepspeed.runtime.pipe.topology`` name by name.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
]


class ProcessTopology:
    """Maps n-dimensional Cartesian coordinates (one per named axis) to linear ranks, row-major.

    ``axes=['x', 'y']`` puts ``(x, y)`` and ``(x, y + 1)`` on adjacent ranks. Methods that return coordinates
    return ``ProcessCoord`` namedtuples whose fields are the axis names.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), list(dims)
        _check_axes_and_dims(axes, dims)
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        ranges = [range(d) for d in dims]
        self._coords = [self.ProcessCoord(*c) for c in itertools.product(*ranges)]
        self.mapping = {coord: rank for rank, coord in enumerate(self._coords)}

    def get_rank(self, **coord_kwargs: int) -> int:
        """The global rank of the process at the given coordinate (one keyword per axis)."""
        if len(coord_kwargs) != len(self.axes):
            raise ValueError(f"get_rank() needs a coordinate on every axis {self.axes}, got {coord_kwargs} "
                             "(it does not support slices; use filter_match())")
        for axis, value in coord_kwargs.items():
            self._check_index(axis, value, "get_rank")
        return self.mapping[self.ProcessCoord(**coord_kwargs)]

    def get_axis_names(self) -> list[str]:
        """The axis names, in the topology's order."""
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """A string of ``rank``'s coordinate, used in checkpoint file names: ``'a_01-b_01'``."""
        omit = frozenset(omit_axes)
        coord = self.get_coord(rank)
        names = [f"{ax}{inner_sep}{getattr(coord, ax):02d}" for ax in self.axes if ax not in omit]
        return outer_sep.join(names)

    def get_dim(self, axis: str) -> int:
        """The number of processes along ``axis`` (0 for an axis the topology does not have)."""
        if axis not in self.axes:
            return 0
        return self.dims[self.axes.index(axis)]

    def get_coord(self, rank: int) -> Any:
        """The ``ProcessCoord`` owned by ``rank``."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(self._coords):
            raise ValueError(f"rank {rank!r} not found in topology (ranks are 0..{len(self._coords) - 1})")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Rank lists for communicator groups along ``axis``: each list's coordinates agree on every other axis.

        An axis the topology does not have gives ``[]`` (so hybrid-parallel code can ask for any axis).
        """
        if axis not in self.axes:
            return []
        other_axes = [a for a in self.axes if a != axis]
        lists = []
        for coord in itertools.product(*[range(self.get_dim(a)) for a in other_axes]):
            others = dict(zip(other_axes, coord, strict=True))
            lists.append([self.mapping[self.ProcessCoord(**others, **{axis: i})]
                          for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinates match every ``axis=value`` given, in rank order."""
        for axis in filter_kwargs:
            self._check_axis(axis, "filter_match")
        return [rank for rank, coord in enumerate(self._coords)
                if all(getattr(coord, k) == v for k, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on ``axis`` is ``idx``, in rank order."""
        axis_num = self._check_axis(axis, "get_axis_list")
        return [rank for rank, coord in enumerate(self._coords) if coord[axis_num] == idx]

    def world_size(self) -> int:
        """The number of processes in the topology (the product of the dims)."""
        return len(self._coords)

    def __str__(self) -> str:
        return str(self.mapping)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axes={self.axes}, dims={self.dims})"

    def __reduce__(self) -> tuple:
        """Picklable (to hand a topology to spawned ranks) although ``ProcessCoord`` is built per instance."""
        return _rebuild_topology, (type(self), self.axes, self.dims)

    def _check_axis(self, axis: str, where: str) -> int:
        if axis not in self.axes:
            raise ValueError(f"{where}(): axis {axis!r} is not in this topology's axes {self.axes}")
        return self.axes.index(axis)

    def _check_index(self, axis: str, value: int, where: str) -> None:
        dim = self.dims[self._check_axis(axis, where)]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < dim:
            raise ValueError(f"{where}(): coordinate {axis}={value!r} is out of range (0..{dim - 1})")


def _rebuild_topology(cls: type, axes: list[str], dims: list[int]) -> ProcessTopology:
    topo = cls.__new__(cls)
    ProcessTopology.__init__(topo, axes, dims)
    return topo


def _check_axes_and_dims(axes: list, dims: list) -> None:
    if len(axes) != len(dims):
        raise ValueError(f"ProcessTopology: axes {axes} ({len(axes)} names) and dims {dims} ({len(dims)} sizes) "
                         "must have the same length")
    if not axes:
        raise ValueError("ProcessTopology: axes must name at least one axis")
    for name in axes:
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"ProcessTopology: axis name {name!r} in axes {axes} must be an identifier "
                             "not starting with '_'")
    if len(set(axes)) != len(axes):
        raise ValueError(f"ProcessTopology: axes {axes} repeat a name")
    for name, dim in zip(axes, dims, strict=True):
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"ProcessTopology: dims {dims}: axis {name!r} has size {dim!r}, expected an int >= 1")


class PipeDataParallelTopology(ProcessTopology):
    """Hybrid pipeline and data parallelism, axes ``['pipe', 'data']``: data-parallel peers of one stage are
    adjacent ranks (their gradient all-reduce stays within a node), pipeline neighbours are ``num_dp`` apart."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline, model (tensor-slicing) and data parallelism, axes ``['pipe', 'data', 'model']``: the
    tensor-parallel peers are adjacent ranks."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def _prime_factors(n: int) -> list[int]:
    """Prime factors of ``n`` in ascending order (``12 -> [2, 2, 3]``; ``1 -> []``)."""
    if n <= 0:
        raise ValueError(f"_prime_factors: n={n} is invalid; accepted: a positive integer")
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    if n > 1:
        factors.append(n)
    return factors


def default_topology(world_size: int) -> PipeDataParallelTopology:
    """DeepSpeed's grid when none is given: prime factors of the world size alternate between pipe and data."""
    num_pp = num_dp = 1
    for idx, prime in enumerate(_prime_factors(world_size)):
        if idx % 2 == 0:
            num_pp *= prime
        else:
            num_dp *= prime
    return PipeDataParallelTopology(num_pp=num_pp, num_dp=num_dp)



class PipelineParallelGrid:
    """The mpu-style view of a topology for one rank: its coordinates and the process groups along each axis.

    Every group is created once here, with ``torch.distributed.new_group``, in the same order on every rank of
    ``process_group`` (default: the whole world), so all ranks must build the grid together. Topology rank ``i``
    is the ``i``-th rank of ``process_group``; ranks returned (``stage_to_global``, ``p2p_groups``, group lists)
    are global ranks. ``get_model_parallel_*`` is DeepSpeed's "model" group: every rank of one data-parallel
    replica (all stages and tensor slices), used to agree on overflow and gradient norms;
    ``get_slice_parallel_*`` is the tensor-slicing (``model`` axis) group.
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("PipelineParallelGrid needs torch.distributed initialised (init_process_group)")
        self._members, local_sync = _group_members(process_group)
        self.global_rank = dist.get_rank()
        self.world_size = len(self._members)
        if self.global_rank not in self._members:
            raise ValueError(f"rank {self.global_rank} is not in process_group (ranks {self._members})")
        self._topo = topology if topology is not None else default_topology(self.world_size)
        if not isinstance(self._topo, ProcessTopology):
            raise TypeError(f"topology must be a ProcessTopology, got {type(self._topo).__name__}")
        if self._topo.world_size() != self.world_size:
            raise ValueError(f"topology {self._topo!r} has {self._topo.world_size()} ranks but the process group "
                             f"has {self.world_size}: the product of the dims must be the world size")
        self._topo_rank = self._members.index(self.global_rank)
        self._local_sync = local_sync
        self.data_parallel_size = max(self._topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(self._topo.get_dim("pipe"), 1)
        self.model_parallel_size = max(self._topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.prev_stage = self.stage_id - 1
        self.next_stage = self.stage_id + 1
        self._build_groups()

    def _is_grid_valid(self) -> bool:
        """The topology covers exactly the grid's ranks (always true of a built grid: the constructor checks it)."""
        return self._topo.world_size() == self.world_size

    def _build_groups(self) -> None:
        """DeepSpeed's creation order: replica ("model") groups, data, pipe, then slice groups."""
        replicas = [sorted(self._topo.get_axis_list("data", dp)) if "data" in self._topo.axes
                    else list(range(self.world_size)) for dp in range(self.data_parallel_size)]
        self.ds_model_groups = [[self._members[r] for r in ranks] for ranks in replicas]
        self.ds_model_proc_group, ranks = self._new_groups(self.ds_model_groups)
        self.ds_model_rank = ranks.index(self.global_rank)
        self.ds_model_world_size = len(ranks)
        self.dp_groups = self._comm_lists("data")
        self.dp_proc_group, self.dp_group = self._new_groups(self.dp_groups)
        self.p2p_groups = self._build_p2p_groups()
        self.pipe_groups = self._comm_lists("pipe")
        self.pp_proc_group, self.pp_group = self._new_groups(self.pipe_groups)
        self.model_groups = self._comm_lists("model")
        self.slice_proc_group, self.slice_group = self._new_groups(self.model_groups)

    def _comm_lists(self, axis: str) -> list[list[int]]:
        """Global rank lists along ``axis``; an axis the topology lacks gives one group per rank."""
        lists = self._topo.get_axis_comm_lists(axis) or [[r] for r in range(self.world_size)]
        return [[self._members[r] for r in ranks] for ranks in lists]

    def _new_groups(self, rank_lists: list[list[int]]) -> tuple[Any, list[int]]:
        """Create every group of ``rank_lists`` (the same calls on every rank); return this rank's one."""
        mine: tuple[Any, list[int]] | None = None
        for ranks in rank_lists:
            group = dist.new_group(ranks=ranks, use_local_synchronization=self._local_sync)
            if self.global_rank in ranks:
                mine = (group, ranks)
        assert mine is not None, f"rank {self.global_rank} is in none of {rank_lists}"
        return mine

    def _build_p2p_groups(self) -> list[list[int]]:
        """``[rank, next rank in its pipeline (wrapping)]`` for every rank, in rank order."""
        p2p = []
        for rank in range(self.world_size):
            coord = self._topo.get_coord(rank)
            stage = getattr(coord, "pipe", 0)
            buddy = self._topo_rank_of(coord, (stage + 1) % self.pipe_parallel_size)
            p2p.append([self._members[rank], self._members[buddy]])
        return p2p

    def _topo_rank_of(self, coord: Any, stage_id: int, **kwargs: int) -> int:
        if "pipe" not in self._topo.axes:
            if stage_id != 0:
                raise ValueError(f"stage_id={stage_id}: the topology has no 'pipe' axis (one stage, id 0)")
            return self._topo.get_rank(**coord._replace(**kwargs)._asdict())
        return self._topo.get_rank(**coord._replace(pipe=stage_id, **kwargs)._asdict())

    def get_stage_id(self) -> int:
        """This rank's pipeline stage (its coordinate on the ``pipe`` axis)."""
        return getattr(self._topo.get_coord(self._topo_rank), "pipe", 0)

    def get_data_parallel_id(self) -> int:
        """Which pipeline (data-parallel replica) this rank belongs to."""
        return getattr(self._topo.get_coord(self._topo_rank), "data", 0)

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank at ``stage_id`` with this rank's other coordinates (overridden by ``kwargs``)."""
        if not 0 <= stage_id < self.pipe_parallel_size:
            raise ValueError(f"stage_to_global(): stage_id={stage_id} is out of range "
                             f"(0..{self.pipe_parallel_size - 1})")
        me = self._topo.get_coord(self._topo_rank)
        bad = [k for k in kwargs if k not in self._topo.axes or k == "pipe"]
        if bad:
            raise ValueError(f"stage_to_global(): {bad} are not non-pipe axes of {self._topo.axes}")
        return self._members[self._topo_rank_of(me, stage_id, **kwargs)]

    @property
    def prev_rank(self) -> int | None:
        """The global rank of the previous stage in this pipeline (``None`` on the first stage)."""
        return None if self.is_first_stage else self.stage_to_global(self.prev_stage)

    @property
    def next_rank(self) -> int | None:
        """The global rank of the next stage in this pipeline (``None`` on the last stage)."""
        return None if self.is_last_stage else self.stage_to_global(self.next_stage)

    def topology(self) -> ProcessTopology:
        return self._topo

    # MPU functions for DeepSpeed integration
    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        """The stage of the pipeline this rank resides in."""
        return self.get_stage_id()

    def get_pipe_parallel_world_size(self) -> int:
        """The number of stages in the pipeline."""
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        """The ranks of this rank's pipeline (one per stage)."""
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        """Which pipeline this rank resides in."""
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        """The number of pipelines."""
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        """The ranks holding the same stage and slice in every pipeline (gradient all-reduce)."""
        return self.dp_proc_group

    def get_model_parallel_rank(self) -> int:
        """This rank's index within its data-parallel replica (all stages and slices)."""
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        """This rank's tensor-slice index (its ``model`` coordinate; 0 without a ``model`` axis)."""
        return getattr(self._topo.get_coord(self._topo_rank), "model", 0)

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group


def _group_members(process_group: Any) -> tuple[list[int], bool]:
    """The global ranks of ``process_group`` (``None`` or WORLD: all ranks), and whether it is a strict subgroup
    (its groups are then created with a group-local barrier, so ranks outside it need not take part)."""
    world = dist.get_world_size()
    if process_group is None or process_group is dist.group.WORLD:
        return list(range(world)), False
    members = list(dist.get_process_group_ranks(process_group))
    return members, len(members) != world
