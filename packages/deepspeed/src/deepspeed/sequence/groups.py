"""Sequence-parallel process groups from the config's ``sequence_parallel_size`` and the ZeRO wiring for them.

Without a client ``mpu``, ``sequence_parallel_size: P`` splits the world into blocks of P consecutive ranks (one
sequence group each, as DeepSpeed's ``parallel_state_sp``); ranks with the same position in their block form a
data-parallel group, and the whole world is the sequence-data-parallel group that gradients are reduced over and
ZeRO partitions over. Sequence ranks hold parts of the same samples, so their gradients are summed, while data
parallel ranks' are averaged: every reduction over the sequence-data group divides by the data-parallel size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ds_config import ConfigError, ConfigProblem


class SequenceParallelGroups:
    """An mpu with a sequence axis: ``sp`` consecutive ranks per sequence group, no model parallelism."""

    def __init__(self, sp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        if sp < 1 or world % sp:
            raise ConfigError(ConfigProblem("sequence_parallel_size", f"must divide the world size ({world}); "
                                            f"accepted: a divisor of {world}", sp))
        self.sp, self.dp = sp, world // sp
        # every rank creates every group, in the same order (torch.distributed.new_group is collective)
        sequence = [dist.new_group(list(range(b * sp, (b + 1) * sp))) for b in range(self.dp)]
        data = [dist.new_group(list(range(i, world, sp))) for i in range(sp)]
        self._sequence, self._data = sequence[rank // sp], data[rank % sp]
        self._rank = rank

    def get_sequence_parallel_group(self) -> Any:
        return self._sequence

    def get_sequence_parallel_world_size(self) -> int:
        return self.sp

    def get_sequence_parallel_rank(self) -> int:
        return self._rank % self.sp

    def get_sequence_data_parallel_group(self) -> Any:
        return dist.group.WORLD

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.sp * self.dp

    def get_sequence_data_parallel_rank(self) -> int:
        return self._rank

    def get_data_parallel_group(self) -> Any:
        return self._data

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return self._rank // self.sp

    def get_model_parallel_group(self) -> Any:
        from deepspeed.utils import groups

        return groups._self_group()  # no model parallelism: this rank alone (gradient norms are local)

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1


# sequence_parallel_size -> (the default group they were built under, the groups): every engine of a process uses
# the same groups, as DeepSpeed builds them once (a new set per initialize would leak process groups)
_BUILT: dict[int, tuple[Any, SequenceParallelGroups]] = {}


def sequence_mpu(mpu: Any, sequence_parallel_size: int) -> Any:
    """The mpu the engine uses: the client's (checked against ``sequence_parallel_size`` when that is set), else
    a ``SequenceParallelGroups`` for ``sequence_parallel_size > 1`` (one per size and default group), else None."""
    if mpu is not None:
        has = int(mpu.get_sequence_parallel_world_size()) if hasattr(mpu, "get_sequence_parallel_world_size") else 1
        if sequence_parallel_size > 1 and has != sequence_parallel_size:
            raise ConfigError(ConfigProblem("sequence_parallel_size", f"the model-parallel unit (mpu) in use has a "
                                            f"sequence-parallel size of {has}; accepted: {has} (or leave the key "
                                            "unset)", sequence_parallel_size))
        if has > 1 and not hasattr(mpu, "get_data_parallel_group"):
            # a sequence-only mpu (runtime.sequence_parallel.parallel_state_sp, which ALST's
            # register_with_transformers returns): its groups are blocks of consecutive ranks, as ours
            return _groups_of_size(has)
        return mpu
    if sequence_parallel_size > 1:
        return _groups_of_size(sequence_parallel_size)
    return None


def _groups_of_size(sequence_parallel_size: int) -> SequenceParallelGroups:
    cached = _BUILT.get(sequence_parallel_size)
    if cached is None or cached[0] is not dist.group.WORLD:  # groups of an earlier default group are gone
        cached = (dist.group.WORLD, SequenceParallelGroups(sequence_parallel_size))
        _BUILT[sequence_parallel_size] = cached
    return cached[1]


def sequence_factor(reduce_group: Any, dp_group: Any, dp_world_size: int) -> int:
    """How many sequence ranks share each sample: the size of the reduction group over the data-parallel size
    (1 without sequence parallelism, where the engine reduces over the data-parallel group itself)."""
    if reduce_group is None or reduce_group is dp_group or not dist.is_initialized():
        return 1
    return dist.get_world_size(reduce_group) // max(dp_world_size, 1)


def zero12_group_comms(optimizer: torch.optim.Optimizer, reduce_group: Any, dp_world_size: int) -> dict[int, Any]:
    """ZeRO 1/2 with sequence parallelism: every parameter group partitioned and reduced over the
    sequence-data-parallel group, its gradient sums divided by the data-parallel size only."""
    from ds_zero.stage_1_and_2 import GroupComm

    comm = GroupComm(reduce_group, dist.get_world_size(reduce_group), grad_divisor=float(dp_world_size))
    return dict.fromkeys(range(len(optimizer.param_groups)), comm)


def sum_over_sequence_ranks(reducer: Any, factor: int) -> None:
    """ZeRO-3 with sequence parallelism: its reduce-scatter averages over the sequence-data group (``factor`` x
    data-parallel ranks); scaling each reduced slice by ``factor`` turns that into the sum over the sequence ranks
    averaged over data parallelism (the reduced slice is a view of a pooled buffer, scaled in place)."""
    if factor == 1:
        return
    deliver = reducer.add_to_partition

    def add_summed(param: torch.nn.Parameter, reduced: torch.Tensor) -> None:
        deliver(param, reduced.mul_(factor))

    reducer.add_to_partition = add_summed
