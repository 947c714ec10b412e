"""The MiCS and ZeRO++ options of ``zero_optimization``, resolved into process groups and the partition space.

``ZeroPPOptions`` carries the config values (no torch.distributed state); :func:`partition_group` picks the
group parameters are partitioned over (the MiCS shard group, or the data-parallel group), :func:`zeropp_space`
turns a plain ``PartitionSpace`` into a :class:`ZeroPPSpace` carrying what the gathers need (hpZ secondary
group, MiCS hierarchy, quantization), and :func:`configure_reducer` gives the gradient reduce-scatter its MiCS
replica all-reduce and qgZ quantized all-to-all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

import torch.distributed as dist

from ds_zero.zero3.param import PartitionSpace
from ds_zero.zeropp.groups import SubGroup, across_group, block_group, check_size, single_group, sub_group
from ds_zero.zeropp.quant import DEFAULT_BLOCK


@dataclass(frozen=True)
class ZeroPPOptions:
    """``mics_shard_size`` (-1/0: off), ``mics_hierarchical_params_gather``, ``zero_hpz_partition_size`` (1: off),
    ``zero_quantized_weights``, ``zero_quantized_nontrainable_weights``, ``zero_quantized_gradients``,
    ``zeropp_loco_param`` (``{"err_beta", "reset_T"}`` or None); ``node_size``: ranks per node (0: the
    launcher's ``LOCAL_WORLD_SIZE``); ``block``: elements per quantization scale."""

    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False
    zero_hpz_partition_size: int = 1
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    zeropp_loco_param: dict[str, Any] | None = None
    node_size: int = 0
    block: int = DEFAULT_BLOCK

    @classmethod
    def from_config(cls, zero: Any) -> ZeroPPOptions:
        """From a ``DeepSpeedZeroConfig`` (or any object/dict with the documented field names)."""
        get = zero.get if isinstance(zero, dict) else (lambda key, default: getattr(zero, key, default))
        values = {f.name: get(f.name, f.default) for f in fields(cls) if f.name not in ("node_size", "block")}
        values["mics_shard_size"] = int(values["mics_shard_size"] or -1)
        values["zero_hpz_partition_size"] = int(values["zero_hpz_partition_size"] or 1)
        return cls(**values)

    @property
    def mics(self) -> bool:
        return self.mics_shard_size > 0

    @property
    def active(self) -> bool:
        return (self.mics or self.zero_hpz_partition_size > 1 or self.zero_quantized_weights
                or self.zero_quantized_nontrainable_weights or self.zero_quantized_gradients)

    def ranks_per_node(self, world: int) -> int:
        """Ranks per node inside a group of ``world`` ranks: ``node_size`` or ``LOCAL_WORLD_SIZE``, capped at
        ``world`` (one node when it does not divide ``world``)."""
        size = self.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
        size = max(1, min(size, world))
        return size if world % size == 0 else world


@dataclass(frozen=True)
class ZeroPPSpace(PartitionSpace):
    """A partition space with MiCS/ZeRO++ gathers: ``secondary`` (hpZ group: the secondary partition is kept
    after a forward gather and backward gathers come from it), ``hierarchy`` (MiCS: ``(across nodes, within a
    node)`` sub-groups of the shard group for a two-stage gather), ``quantize`` (qwZ: int8 all-gathers),
    ``quantize_frozen`` (the same for parameters that do not train), ``block`` (elements per scale)."""

    secondary: SubGroup | None = None
    hierarchy: tuple[SubGroup, SubGroup] | None = None
    quantize: bool = False
    quantize_frozen: bool = False
    block: int = DEFAULT_BLOCK


def _dp_world(dp_group: Any) -> int:
    return dist.get_world_size(dp_group) if dist.is_available() and dist.is_initialized() else 1


def partition_group(dp_group: Any, options: ZeroPPOptions) -> Any:
    """The group parameters are partitioned over: this rank's MiCS shard group, or ``dp_group``."""
    if not options.mics:
        return dp_group
    check_size("mics_shard_size", options.mics_shard_size, _dp_world(dp_group))
    if options.mics_shard_size == 1 and dist.is_initialized() and _dp_world(dp_group) > 1:
        return single_group().group  # whole states on every rank, replicated over the data-parallel group
    return block_group(dp_group, options.mics_shard_size).group


def replica_group(dp_group: Any, options: ZeroPPOptions) -> SubGroup | None:
    """MiCS: the ranks holding the same shard in every shard group (None without MiCS or with one replica)."""
    if not options.mics or options.mics_shard_size == _dp_world(dp_group):
        return None
    return across_group(dp_group, options.mics_shard_size)


def zeropp_space(space: PartitionSpace, dp_group: Any, options: ZeroPPOptions) -> PartitionSpace:
    """``space`` (over :func:`partition_group` of ``dp_group``) with the MiCS/ZeRO++ gathers, or ``space`` itself
    when none is on."""
    if not options.active or not dist.is_initialized():
        return space
    secondary = hierarchy = None
    hpz = options.zero_hpz_partition_size
    if hpz > 1:
        check_size("zero_hpz_partition_size", hpz, space.world)
        if hpz < space.world:
            secondary = sub_group(dp_group, space.world, hpz, "block")
    if options.mics and options.mics_hierarchical_params_gather:
        node = options.ranks_per_node(space.world)
        if 1 < node < space.world:
            hierarchy = (sub_group(dp_group, space.world, node, "across"),
                         sub_group(dp_group, space.world, node, "block"))
    base = {f.name: getattr(space, f.name) for f in fields(PartitionSpace)}
    return ZeroPPSpace(**base, secondary=secondary, hierarchy=hierarchy, quantize=options.zero_quantized_weights,
                       quantize_frozen=options.zero_quantized_nontrainable_weights, block=options.block)


def configure_reducer(reducer: Any, dp_group: Any, options: ZeroPPOptions, comm: Any) -> None:
    """Give the ZeRO-3 gradient reduce-scatter (over :func:`partition_group` of ``dp_group``) MiCS's all-reduce
    across replicas and qgZ's quantized hierarchical all-to-all."""
    from ds_zero.zeropp.qgz import QuantizedReduce

    qgz = None
    if options.zero_quantized_gradients and reducer.world > 1:
        node = options.ranks_per_node(reducer.world)
        qgz = QuantizedReduce(sub_group(dp_group, reducer.world, node, "block"),
                              sub_group(dp_group, reducer.world, node, "across"), comm, options.block,
                              options.zeropp_loco_param)
    reducer.configure_zeropp(replica=replica_group(dp_group, options), qgz=qgz)
