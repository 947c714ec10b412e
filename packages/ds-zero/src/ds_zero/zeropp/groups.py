"""Sub-groups of a data-parallel group for MiCS and ZeRO++.

The data-parallel group (``parent``) is cut into blocks of ``outer`` consecutive ranks (MiCS shard groups; the
whole group without MiCS); inside every block, groups of ``inner`` ranks are either consecutive (``"block"``: an
hpZ secondary group, a node) or strided (``"across"``: the ranks at the same place in every inner block, e.g.
MiCS's replica groups with ``outer`` = the whole group, or qgZ's inter-node group).

Creating a process group is collective over the world: every rank creates every group of every block, of every
data-parallel group (with model or pipeline parallelism there are several; their rank lists are exchanged
first), in the same order, and keeps its own. Groups are cached by (parent ranks, outer, inner, kind), so
``MiCS_Init`` and ``deepspeed.initialize`` share them; a new default process group empties the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class SubGroup:
    """A process group this rank belongs to: ``group`` (None: the default world group, or a group of one rank
    that never communicates), ``world`` ranks, this rank's ``rank`` in it."""

    group: Any
    world: int
    rank: int


_CACHE: dict[tuple, SubGroup] = {}
_WORLD: list[Any] = [None]  # the default group the cache was built under


def check_size(name: str, size: int, world: int) -> None:
    """``size`` must divide ``world`` (a clear error naming the option ``name`` otherwise)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
        raise ValueError(f"{name}={size!r} must be a positive divisor of the data-parallel world size {world}; "
                         f"accepted: {[d for d in range(1, world + 1) if world % d == 0]}")


def _ranks(parent: Any) -> list[int]:
    return dist.get_process_group_ranks(parent) if parent is not None else list(range(dist.get_world_size()))


def _all_parents(mine: list[int]) -> list[tuple[int, ...]]:
    """Every rank's data-parallel rank list (one when it is the world), in one order on every rank."""
    if len(mine) == dist.get_world_size():
        return [tuple(mine)]
    lists: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(lists, tuple(mine))
    return sorted(set(lists))


def _members(ranks: tuple[int, ...], outer: int, inner: int, kind: str) -> list[list[int]]:
    out = []
    for b in range(len(ranks) // outer):
        block = ranks[b * outer:(b + 1) * outer]
        if kind == "block":
            out += [list(block[k * inner:(k + 1) * inner]) for k in range(outer // inner)]
        else:
            out += [[block[k * inner + i] for k in range(outer // inner)] for i in range(inner)]
    return out


def _new_group(ranks: list[int]) -> Any:
    if ranks == list(range(dist.get_world_size())):
        return None  # the whole world: the default group
    return dist.new_group(ranks)


def sub_group(parent: Any, outer: int, inner: int, kind: str) -> SubGroup:
    """This rank's group of ``kind`` (``"block"`` or ``"across"``) with ``inner`` ranks per inner block, inside
    its block of ``outer`` consecutive ranks of ``parent`` (None: the world). Collective over the world."""
    _drop_stale()
    mine = _ranks(parent)
    key = (tuple(mine), outer, inner, kind)
    if key not in _CACHE:
        check_size("sub-group size", inner, outer)
        check_size("partition group size", outer, len(mine))
        _CACHE[key] = _build(mine, outer, inner, kind)
    return _CACHE[key]


def _drop_stale() -> None:
    if dist.group.WORLD is not _WORLD[0]:  # a new default group: the cached groups belong to the old one
        _CACHE.clear()
        _WORLD[0] = dist.group.WORLD


def single_group() -> SubGroup:
    """This rank alone as a real process group (a MiCS shard group of one rank: the partitions are whole, and
    ``None`` would mean the default group). Collective over the world: every rank creates every one-rank group."""
    _drop_stale()
    if ("single",) not in _CACHE:
        me = dist.get_rank()
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        _CACHE[("single",)] = SubGroup(groups[me], 1, 0)
    return _CACHE[("single",)]


def _build(mine: list[int], outer: int, inner: int, kind: str) -> SubGroup:
    me = dist.get_rank()
    size = inner if kind == "block" else outer // inner
    if size == 1:  # groups of one rank never communicate: no process group is created
        return SubGroup(None, 1, 0)
    found = None
    for parent in _all_parents(mine):  # every rank creates every group, in the same order
        for ranks in _members(parent, outer, inner, kind):
            group = _new_group(ranks)
            if me in ranks:
                found = SubGroup(group, len(ranks), ranks.index(me))
    assert found is not None
    return found


def block_group(parent: Any, size: int) -> SubGroup:
    """This rank's block of ``size`` consecutive ranks of ``parent`` (a MiCS shard group)."""
    return sub_group(parent, len(_ranks(parent)), size, "block")


def across_group(parent: Any, size: int) -> SubGroup:
    """The ranks of ``parent`` at this rank's place in every block of ``size`` (a MiCS replica group)."""
    return sub_group(parent, len(_ranks(parent)), size, "across")
