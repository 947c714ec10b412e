"""The unit the ZeRO stage 1/2 gradient reducer (:mod:`ds_zero._reduce`) sends: a bucket of parameters, and the
channel (process group and divisor) it is reduced over. Who owns a bucket's buffers when: see ``_reduce``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_zero._flat_group import FlatGroup

__all__ = ["Bucket", "Channel"]


@dataclass(frozen=True, eq=False)
class Channel:
    """The ranks a bucket is reduced over: ``group`` of ``world`` ranks (this one is ``rank``), the divisor of
    the summed gradients, and whether pieces travel point to point (gloo)."""

    group: Any
    world: int
    rank: int
    divisor: float
    p2p: bool

    @classmethod
    def of(cls, fg: FlatGroup) -> Channel:
        world = fg.layout.world_size
        p2p = world > 1 and dist.get_backend(fg.process_group) == "gloo"
        return cls(fg.process_group, world, fg.rank, fg.grad_divisor, p2p)

    def peer(self, rank: int) -> int:
        """The global rank of ``rank`` in this channel's group."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


class Bucket:
    """A run of parameters reduced together (one dtype, one :class:`Channel`): their offsets in the
    communication buffer and the buffers and collectives of the reduction in progress."""

    def __init__(self, params: list[torch.nn.Parameter], dtype: torch.dtype, device: torch.device,
                 channel: Channel) -> None:
        self.params = params
        self.channel = channel
        self.offsets = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel, self.dtype, self.device = total, dtype, device
        self.flat: torch.Tensor | None = None  # the communication buffer while packed or in flight
        self.store: torch.Tensor | None = None  # stage 1, CPU: the parameters' full gradients (see grad_slot)
        self.direct = False  # stage 1: reduced straight from ``store``, which the reduction never writes
        self.acc: torch.Tensor | None = None  # direct: this rank's summed pieces (the staging itself on 2 ranks)
        self.pooled = False  # flat is a view of a pooled buffer (returned to the pool when done)
        self.runs: list[tuple[int, int, int]] | None = None  # (owner, offset, numel): the reducer's _owner_runs
        self.own: list[tuple[int, int, int, int]] | None = None  # this rank's pieces: the reducer's _own_slices
        self.staging: torch.Tensor | None = None  # receives the peers' copies of this rank's pieces (gloo)
        self.staged = False  # staging is a pooled buffer (returned to the pool when done)
        self.pending: list[int] = []  # channel ranks whose copies are still to be received (more than 2 ranks)
        self.receives: list[Any] = []  # the receives in flight into staging
        self.ready: set[int] = set()
        self.filled: set[int] = set()  # slots already copied into ``flat`` as their gradients landed
        self.works: list[Any] = []  # the collective, or the exchange's sends

    def slice(self, i: int, flat: torch.Tensor | None = None) -> torch.Tensor:
        return (self.flat if flat is None else flat).narrow(0, self.offsets[i], self.params[i].numel())
