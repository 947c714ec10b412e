"""The transport of the ZeRO++/MiCS collectives: all-gather and all-to-all of flat tensors over a process
group, point to point on small gloo groups (as ``ds_zero.gather`` and the ZeRO-3 gathers do: faster than gloo's
collectives on CPU), otherwise torch's collectives. Every call counts the bytes this rank sends
(``ds_zero.zeropp.traffic``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ds_zero.gather import P2P_MAX_WORLD
from ds_zero.zeropp.traffic import record


def _p2p(group: Any, world: int) -> bool:
    return dist.get_backend(group) == "gloo" and world <= P2P_MAX_WORLD


def _peer(group: Any, r: int) -> int:
    return dist.get_global_rank(group, r) if group is not None else r


def start_all_gather(out: torch.Tensor, mine: torch.Tensor, group: Any, world: int, rank: int, comm: Any,
                     kind: str) -> list[Any]:
    """Start gathering every rank's ``mine`` (same size everywhere) into ``out`` (``world * mine.numel()``
    elements, rank order); this rank's chunk is copied here. Returns the works to wait for."""
    n = mine.numel()
    out.narrow(0, rank * n, n).copy_(mine)
    if world == 1 or n == 0:
        return []
    record(kind, (world - 1) * n * mine.element_size())
    if _p2p(group, world):
        ops = []
        for r in range(world):
            if r != rank:
                ops.append(dist.P2POp(dist.isend, mine, _peer(group, r), group))
                ops.append(dist.P2POp(dist.irecv, out.narrow(0, r * n, n), _peer(group, r), group))
        return list(comm.batch_isend_irecv(ops))
    return [comm.all_gather_into_tensor(out, mine.clone(), group=group, async_op=True)]


def all_gather(out: torch.Tensor, mine: torch.Tensor, group: Any, world: int, rank: int, comm: Any,
               kind: str) -> torch.Tensor:
    for work in start_all_gather(out, mine, group, world, rank, comm, kind):
        work.wait()
    return out


def all_to_all(rows: torch.Tensor, group: Any, world: int, rank: int, comm: Any, kind: str) -> torch.Tensor:
    """``rows`` is ``[world, n]``: row ``r`` goes to rank ``r``. Returns ``[world, n]`` whose row ``r`` came from
    rank ``r`` (this rank's own row is copied)."""
    out = torch.empty_like(rows)
    out[rank].copy_(rows[rank])
    if world == 1:
        return out
    record(kind, (world - 1) * rows[0].numel() * rows.element_size())
    if _p2p(group, world):
        ops = []
        for r in range(world):
            if r != rank:
                ops.append(dist.P2POp(dist.isend, rows[r].contiguous(), _peer(group, r), group))
                ops.append(dist.P2POp(dist.irecv, out[r], _peer(group, r), group))
        works = comm.batch_isend_irecv(ops)
    else:
        a2a = getattr(comm, "all_to_all_single", dist.all_to_all_single)
        works = [a2a(out, rows.contiguous(), group=group, async_op=True)]
    for work in works:
        work.wait()
    return out


def all_reduce_sum(t: torch.Tensor, group: Any, world: int, comm: Any, kind: str) -> torch.Tensor:
    """Sum ``t`` in place over ``group``."""
    if world > 1:
        record(kind, 2 * (world - 1) * t.numel() * t.element_size() // world)
        comm.all_reduce(t, group=group)
    return t
