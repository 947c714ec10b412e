"""Partition bookkeeping: which data-parallel rank owns which slice of which parameter.

A :class:`FlatLayout` places a sequence of tensors (by element count) back to back in one flat buffer, pads
the end so the total divides evenly into ``world_size`` equal partitions (aligned to ``alignment`` elements),
and answers the two questions every ZeRO stage asks: where does tensor ``i`` live in the flat buffer, and
which pieces of which tensors fall into rank ``r``'s partition (:class:`Fragment`). Stages 1 and 2 use one
layout per optimizer parameter group (DeepSpeed's ``single_partition_of_fp32_groups`` layout, with its
``2 * world_size`` alignment, so ``zero_to_fp32`` reads our checkpoints); stage 3 can use one layout per
parameter. Nothing here touches tensors or processes: it is arithmetic on element counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Fragment:
    """``numel`` elements of tensor ``index``: from ``tensor_offset`` in the tensor (flattened), stored at
    ``partition_offset`` in the owning rank's partition and at ``flat_offset`` in the whole flat buffer."""

    index: int
    tensor_offset: int
    partition_offset: int
    flat_offset: int
    numel: int


def nccl_alignment(world_size: int) -> int:
    """DeepSpeed's stage 1/2 alignment: ``2 * world_size`` elements (keeps partition starts 4-byte aligned)."""
    return 2 * world_size


class FlatLayout:
    """Tensors of sizes ``numels`` (in this order) in one flat buffer split into ``world_size`` partitions."""

    def __init__(self, numels: Sequence[int], world_size: int, alignment: int | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"FlatLayout: world_size must be >= 1, got {world_size}")
        if any(n < 0 for n in numels):
            raise ValueError(f"FlatLayout: element counts must be >= 0, got {list(numels)}")
        self.numels = [int(n) for n in numels]
        self.world_size = world_size
        self.alignment = alignment or nccl_alignment(world_size)
        if self.alignment % world_size:
            raise ValueError(f"FlatLayout: alignment {self.alignment} is not a multiple of world_size {world_size}")
        self.offsets = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total
        self.padded_numel = -(-total // self.alignment) * self.alignment if total else 0
        self.padding = self.padded_numel - total
        self.partition_numel = self.padded_numel // world_size

    def partition_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of rank ``rank``'s partition in the flat buffer."""
        start = rank * self.partition_numel
        return start, start + self.partition_numel

    @cached_property
    def _fragments(self) -> list[list[Fragment]]:
        per_rank: list[list[Fragment]] = [[] for _ in range(self.world_size)]
        for index, (offset, numel) in enumerate(zip(self.offsets, self.numels, strict=True)):
            for rank, piece in self._split(index, offset, numel):
                per_rank[rank].append(piece)
        return per_rank

    def _split(self, index: int, offset: int, numel: int) -> list[tuple[int, Fragment]]:
        pieces = []
        end = offset + numel
        pos = offset
        while pos < end:
            rank = pos // self.partition_numel
            part_end = min(end, (rank + 1) * self.partition_numel)
            pieces.append((rank, Fragment(index, pos - offset, pos - rank * self.partition_numel, pos,
                                          part_end - pos)))
            pos = part_end
        return pieces

    def fragments(self, rank: int) -> list[Fragment]:
        """The pieces of tensors that rank ``rank`` owns, in flat order."""
        return self._fragments[rank]

    def owners(self, index: int) -> list[tuple[int, Fragment]]:
        """``(rank, fragment)`` for every piece of tensor ``index`` (one per rank it spans)."""
        return self._split(index, self.offsets[index], self.numels[index])


def round_robin_order(numels: Sequence[int], world_size: int) -> list[int]:
    """DeepSpeed's ``round_robin_gradients`` order: tensor ``i`` goes to list ``i % world_size``, the lists
    concatenated, so each rank's partition holds gradients produced all through backward rather than one
    contiguous run of layers (spreads the gradient copies to CPU across ranks). Returns tensor indices."""
    return [i for r in range(world_size) for i in range(r, len(numels), world_size)]
