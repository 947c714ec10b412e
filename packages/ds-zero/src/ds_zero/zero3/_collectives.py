"""The two ZeRO-3 collectives on parameters: gather whole values from every rank's partitions (started now,
waited for later, so a gather can run ahead of the module that needs it), and broadcast a modified value
back into the partitions (``GatheredParameters(modifier_rank=...)``).

A gather moves every listed parameter in one exchange: the partitions are packed back to back into one
buffer of ``U`` elements, each rank receives ``W * U`` elements (rank ``r``'s buffer at ``[r*U, (r+1)*U)``),
and each parameter's whole value is cut out of that. On gloo with up to four ranks the exchange is point to
point (the same choice as stage 1/2's gather, ``ds_zero.gather``: faster than gloo's all-gather on CPU);
otherwise one ``all_gather_into_tensor``; with ``stage3_use_all_reduce_for_fetch_params`` an all-reduce of a
zeroed buffer holding each rank's slice. ``stage3_allgather_sequential`` makes one exchange per parameter.
Parameters of a MiCS/ZeRO++ partition space are gathered by ``ds_zero.zeropp.gather`` (quantized, hpZ secondary
or hierarchical exchanges), batched by the kind of exchange.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from ds_zero.gather import P2P_MAX_WORLD
from ds_zero.zero3.gather_pool import give, take
from ds_zero.zero3.param import (
    ZeroParamStatus,
    install_full,
    release_partitions,
    swap_in_partitions,
    write_partition_from_full,
)
from ds_zero.zeropp.frozen import is_stored_quantized, write_full
from ds_zero.zeropp.gather import ZeroPPBatch, gather_kind, keep_secondary, uses_zeropp
from ds_zero.zeropp.traffic import record

# id(group) -> (group, default group, world, decision): the entry holds the group so its id cannot be reused by
# another group while cached, and is checked against the objects, so a group destroyed and recreated (a new
# default group, a second engine's groups) never reads another group's decision
_P2P_CACHE: dict[int, tuple[Any, Any, int, bool]] = {}
# point to point, a partition of at least this many elements travels on its own (no packing copies)
_DIRECT_NUMEL = 1 << 16


def _use_p2p(space: Any) -> bool:
    group, world = space.group, dist.group.WORLD
    hit = _P2P_CACHE.get(id(group))
    if hit is None or hit[0] is not group or hit[1] is not world or hit[2] != space.world:
        if hit is not None and hit[1] is not world:  # a new default group: every cached group is gone
            _P2P_CACHE.clear()
        hit = (group, world, space.world, dist.get_backend(group) == "gloo" and space.world <= P2P_MAX_WORLD)
        _P2P_CACHE[id(group)] = hit
    return hit[3]


def _wait_all(works: list[Any]) -> None:
    for work in works:  # in a function of its own: no loop variable outlives it holding a work's tensors
        work.wait()


class _Batch:
    """One exchange: parameters sharing a process group, dtype and compute device."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.space = params[0].ds_space
        self.works: list[Any] = []
        self.out: torch.Tensor | None = None
        self.direct: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._layout(params)

    def _layout(self, packed: list[torch.nn.Parameter]) -> None:
        self.packed, self.offsets, total = packed, [], 0
        for p in packed:
            self.offsets.append(total)
            total += p.ds_tensor.numel()
        self.unit = total

    def start(self) -> None:
        space, comm = self.space, self.space.comm
        dtype, device = self.params[0].dtype, space.compute_device
        for p in self.params:
            p.ds_status = ZeroParamStatus.INFLIGHT
        if space.world > 1:  # what this rank sends: its partitions to every other rank (the ZeRO++ baseline)
            record("param_gather", (space.world - 1) * sum(p.ds_tensor.numel() for p in self.params)
                   * self.params[0].element_size())
        if space.world > 1 and not space.fetch_all_reduce and _use_p2p(space):
            self.works = list(comm.batch_isend_irecv(self._p2p_ops(dtype, device)))
            return
        mine = self._pack(dtype, device)
        if space.world == 1 or self.unit == 0:
            return
        if space.fetch_all_reduce:  # every rank contributes its slice to a zeroed buffer; the sum is the whole
            self.works = [comm.all_reduce(self.out, group=space.group, async_op=True)]
        else:
            self.works = [comm.all_gather_into_tensor(self.out, mine.clone(), group=space.group, async_op=True)]

    def _p2p_ops(self, dtype: torch.dtype, device: torch.device) -> list[Any]:
        """Large partitions travel on their own, from ``ds_tensor`` straight into the slices of the parameter's
        whole value (no packing before, no unpacking after); the small ones share one packed buffer."""
        space, ops = self.space, []
        for p in self.params:
            part = p.ds_tensor.numel()
            if part >= _DIRECT_NUMEL:
                full = take(space.world * part, dtype, device)
                full.narrow(0, space.rank * part, part).copy_(p.ds_tensor)
                self.direct.append((p, full))
                ops += self._exchange(p.ds_tensor, lambda r, full=full, part=part: full.narrow(0, r * part, part))
        self._layout([p for p in self.params if p.ds_tensor.numel() < _DIRECT_NUMEL])
        if self.unit:
            mine = self._pack(dtype, device)
            ops += self._exchange(mine, lambda r: self.out.narrow(0, r * self.unit, self.unit))
        return ops

    def _exchange(self, send: torch.Tensor, recv_of: Any) -> list[dist.P2POp]:
        space, ops = self.space, []
        for r in range(space.world):
            if r != space.rank:
                peer = dist.get_global_rank(space.group, r) if space.group is not None else r
                ops.append(dist.P2POp(dist.isend, send, peer, space.group))
                ops.append(dist.P2POp(dist.irecv, recv_of(r), peer, space.group))
        return ops

    def _pack(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        space = self.space
        self.out = take(space.world * self.unit, dtype, device)
        if space.fetch_all_reduce:
            self.out.zero_()
        mine = self.out.narrow(0, space.rank * self.unit, self.unit)
        for p, offset in zip(self.packed, self.offsets, strict=True):
            mine.narrow(0, offset, p.ds_tensor.numel()).copy_(p.ds_tensor)
        return mine

    def finish(self) -> None:
        _wait_all(self.works)
        self.works = []  # a finished work still refers to its tensors: the pool keeps only unshared buffers
        for p, full in self.direct:
            install_full(p, full[:p.ds_numel], base=full)
        self.direct = []
        if self.out is None:
            return
        world = self.space.world
        grid = self.out.view(world, self.unit)
        for p, offset in zip(self.packed, self.offsets, strict=True):
            part = p.ds_tensor.numel()
            # one parameter's pieces are strided across the rank rows: this copy is its own whole value
            full = take(world * part, grid.dtype, grid.device)
            full.view(world, part).copy_(grid.narrow(1, offset, part))
            install_full(p, full[:p.ds_numel], base=full)
        del grid  # a view of the buffer: the pool keeps only buffers nothing else refers to
        give(self.out)
        self.out = None


class PendingGather:
    """Gathers in flight for a list of parameters; ``wait()`` installs the whole values."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        swap_in_partitions(params)  # ZeRO-Infinity: partitions on NVMe are read before the exchange reads them
        by_kind: dict[tuple, list[torch.nn.Parameter]] = defaultdict(list)
        for p in params:
            key = (id(p.ds_space.group), p.dtype, p.ds_space.compute_device)
            if uses_zeropp(p):  # MiCS/ZeRO++: the source (hpZ) and quantization (qwZ) are part of the exchange
                key = (*key, gather_kind(p))
            by_kind[(*key, p.ds_id) if p.ds_space.sequential else key].append(p)
        self.batches = [ZeroPPBatch(ps) if uses_zeropp(ps[0]) else _Batch(ps) for ps in by_kind.values()]
        self.numel = sum(p.ds_numel for p in params)
        for p in params:
            p.ds_pending = self  # so any later gather of an INFLIGHT parameter (gather_now) waits for this one
        for batch in self.batches:
            batch.start()

    def wait(self) -> None:
        for batch in self.batches:
            batch.finish()
            release_partitions(batch.params)
            for p in batch.params:
                p.ds_pending = None
        self.batches = []


def start_gather(params: list[torch.nn.Parameter]) -> PendingGather:
    """Start gathering ``params`` (all must be NOT_AVAILABLE); every rank must start the same gathers in the
    same order."""
    return PendingGather(params)


def gather_now(params: list[torch.nn.Parameter]) -> None:
    """Gather every listed parameter that is not available yet, and wait for it (also for gathers already in
    flight: a prefetched parameter read by GatheredParameters or another module)."""
    for pending in dict.fromkeys(p.ds_pending for p in params if p.ds_status is ZeroParamStatus.INFLIGHT):
        pending.wait()
    needed = [p for p in params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
    if needed:
        start_gather(needed).wait()


def broadcast_into_partitions(params: list[torch.nn.Parameter], src_rank: int) -> None:
    """Rank ``src_rank``'s whole values (which must be gathered) become every rank's partitions and whole
    values."""
    for p in params:
        space = p.ds_space
        if space.world > 1:
            src = dist.get_global_rank(space.group, src_rank) if space.group is not None else src_rank
            space.comm.broadcast(p.data, src=src, group=space.group)
        if is_stored_quantized(p):  # zero_quantized_nontrainable_weights: quantized again
            write_full(p, p.data)
        else:
            write_partition_from_full(p, p.data)
        if getattr(p, "ds_secondary", None) is not None:  # hpZ: backward gathers read the new values too
            keep_secondary(p, p.data)
