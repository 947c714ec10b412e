"""Gradient averaging into partitions for ZeRO stages 1 and 2 (the engine's ``GradientReducer``).

Parameters are grouped into fixed buckets of about ``reduce_bucket_size`` elements, in reverse parameter
order (the order backward produces gradients). When all of a bucket's gradients have landed it is packed into
a communication buffer (stage 2 then frees each parameter's ``.grad``) and sent, strictly in bucket order so
every rank issues the same collectives in the same order. With ``overlap_comm`` up to two buckets are in
flight while backward continues; otherwise each is waited for at once. When a bucket's collective completes,
this rank's slices of the averaged gradients are added into the groups' gradient partitions and the buffer is
reused, so the reduction holds at most one or two buckets, never a full gradient. How a bucket travels:
- ``reduce_scatter`` with ``use_multi_rank_bucket_allreduce`` (the defaults): one exchange per bucket over all
  the ranks whose partitions it spans. On gloo it is point to point (each rank sends every other owner its
  pieces and sums the copies of its own: 11.4 ms against 16.5 ms for an all-reduce of a 5M-element fp32
  bucket on 2 CPU ranks; gloo's ``reduce_scatter_tensor`` took 24.8 ms); on other backends an all-reduce;
- ``reduce_scatter`` without ``use_multi_rank_bucket_allreduce``: one ``reduce`` to each owning rank per
  contiguous run of the bucket it owns (DeepSpeed's per-rank reduce);
- ``reduce_scatter: false``: one all-reduce per bucket.
Stage 2 (``every_micro_step``) reduces after every backward and adds into its persistent partitions; stage 1
reduces the whole accumulated gradient at the accumulation boundary and replaces the partitions.
Stage 1 on the CPU keeps each bucket's full gradients in a persistent store laid out as the bucket
(``grad_slot``: ``param.grad`` is a view of it, as stage 0's bucket views). Where the bucket travels point to
point in its own dtype with no factor before the sum (the defaults), the exchange sends straight from the store
and sums this rank's pieces into the staging buffer, never writing the store: each gradient is copied once
(autograd's tensor into its slot), and a second backward at the boundary still finds the local gradient there.
Otherwise the store is packed into a communication buffer as a stage-2 bucket is.
``contiguous_gradients`` keeps the communication buffers, and the point-to-point exchange's staging buffers
(as many elements as this rank owns of the largest bucket), allocated and reuses them: no allocation in the hot
path; without it each bucket gets fresh buffers that are freed after its reduction. Stage 2 copies each
gradient into the next bucket's buffer as it lands and frees it at once (DeepSpeed's contiguous-gradient copy),
so autograd reuses that memory for the next layer's gradient rather than handing a whole model's gradients back
to the OS every step (with a fresh receive buffer per bucket: 6,100 page faults per step on a 6.3M-parameter
MLP, none now).
Ownership: a bucket's buffer belongs to backward (filled by ``grad_ready``) until its launch, then to the
collective until ``_complete`` has waited for it; its staging buffer is written by the receives from launch
until ``_sum_received`` has waited for them, then read once and returned to the pool.
A bucket holds parameters of groups that share one process group (a :class:`Channel`): the data-parallel
group, or a MoE expert group's expert-data-parallel group, whose sums are divided by the whole data-parallel
size (``FlatGroup.grad_divisor``) rather than by its own.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_zero._flat_group import FlatGroup
from ds_zero._reduce_bucket import Bucket, Channel
from ds_zero.collectives import TORCH, Collectives

AUTOCAST_COMM_DTYPE_ATTR = "comm_dtype"  # set by deepspeed.runtime.torch_autocast.init_autocast_params


class UnusedParametersError(RuntimeError, AssertionError):
    """Parameters without a gradient in a backward while ``ignore_unused_parameters`` is false (DeepSpeed asserts
    here, so code catching its ``AssertionError`` still catches this)."""


@dataclass(frozen=True)
class ReduceSettings:
    """The gradient-communication part of the config, resolved (element counts, dtypes, factors)."""

    bucket_numel: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    use_multi_rank_bucket_allreduce: bool = True
    ignore_unused_parameters: bool = True
    comm_dtype: torch.dtype | None = None
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    average: bool = True
    """False (``gradient_allreduce_op: sum``): the plain sum over the ranks, no factor before or after."""


class PartitionedReducer:
    """Averages gradients over each group's process group (the data-parallel one unless the group says otherwise)
    into each ``FlatGroup.grad_partition``; ``process_group`` / ``world_size``: the data-parallel group, over
    which the unused-parameter verdict is agreed."""

    def __init__(self, params: list[torch.nn.Parameter], groups: list[FlatGroup],
                 home: dict[torch.nn.Parameter, tuple[int, int]], get_grad: Callable, grad_dtype: Callable,
                 settings: ReduceSettings, process_group: Any, world_size: int, stage: int,
                 comm: Collectives = TORCH) -> None:
        self.comm = comm
        self.every_micro_step = stage >= 2
        self.settings = settings
        self.group = process_group
        self.world = world_size
        self.get_grad = get_grad
        self.grad_dtype = grad_dtype
        self.free_grads = stage >= 2
        self.home = home  # parameter -> (group, index in the group's flat order)
        self.groups = groups
        self.params = [p for p in params if p in self.home]
        self._channels = self._group_channels(groups)
        self.buckets = self._plan(self.params)
        for bucket in self.buckets:
            bucket.direct = self._reduces_from_store(bucket)
        self.where = {p: (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)}
        self.next_launch = 0
        self.coalescing = False
        self._pending_flush = False
        self._inflight: collections.deque[Bucket] = collections.deque()
        self._pool: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._staging: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._unused: list[torch.nn.Parameter] = []
        self._pass_open = False  # a reduction pass (one backward's buckets) has started writing back
        if settings.contiguous_gradients:  # DeepSpeed's contiguous buffer(s), allocated up front
            for pool, sizes in ((self._pool, self._pool_sizes()), (self._staging, self._staging_sizes())):
                for key, size in sizes.items():
                    pool[key] = [torch.empty(size, dtype=key[0], device=key[1])
                                 for _ in range(2 if settings.overlap_comm else 1)]
        self.reduced = False  # the partitions hold this window's averaged gradients

    @staticmethod
    def _group_channels(groups: list[FlatGroup]) -> list[Channel]:
        """Each group's channel; groups over the same process group and divisor share one."""
        channels: dict[tuple[int, int, float], Channel] = {}
        out = []
        for fg in groups:
            key = (id(fg.process_group), fg.layout.world_size, fg.grad_divisor)
            if key not in channels:
                channels[key] = Channel.of(fg)
            out.append(channels[key])
        return out

    def _plan(self, params: list[torch.nn.Parameter]) -> list[Bucket]:
        buckets, current, size = [], [], 0
        for p in reversed(params):  # a bucket never outgrows reduce_bucket_size unless one parameter does
            if current and size + p.numel() > self.settings.bucket_numel:
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            buckets.append(current)
        out = []
        for members in buckets:  # split by communication dtype and process group, keeping the order
            split: dict[tuple[torch.dtype, int], list[torch.nn.Parameter]] = {}
            for p in members:
                channel = self._channels[self.home[p][0]]
                split.setdefault((self._comm_dtype(p), id(channel)), []).append(p)
            out.extend(Bucket(ps, dtype, ps[0].device, self._channels[self.home[ps[0]][0]])
                       for (dtype, _), ps in split.items())
        return out

    def _reduces_from_store(self, bucket: Bucket) -> bool:
        """Stage 1: is ``bucket`` sent straight from its gradient store? (on the CPU, where ``grad_slot`` keeps
        the gradients; in their own dtype; point to point, which only reads what it sends; no factor before
        the sum, which would have to be written somewhere)"""
        return (not self.free_grads and self._uses_exchange(bucket) and self._pre_factor(bucket.channel) == 1.0
                and all(p.device.type == "cpu" and p.dtype == bucket.dtype == self.grad_dtype(p)
                        for p in bucket.params))

    def _pre_factor(self, channel: Channel) -> float:
        """Multiplier applied to a bucket before the sum."""
        s = self.settings
        if not s.average:
            return 1.0
        return 1.0 / channel.divisor if s.prescale_gradients else 1.0 / s.gradient_predivide_factor

    def grad_slot(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """Stage 1: where ``param``'s full gradient lives from its first backward to the step, a view of its
        bucket's persistent store (allocated on first use), or None (stage 2, or a parameter whose dtype is not
        its bucket's store's). The optimizer copies autograd's fresh gradient into it and points ``param.grad``
        at it, so autograd's memory serves the next layer's gradient (freed together at ``zero_grad``, a model's
        gradients went back to the OS every step and came back as page faults), later micro-steps accumulate
        into it in place, and a direct bucket is sent from it with no copy."""
        where = self.where.get(param)
        if where is None or self.free_grads:
            return None
        bucket = self.buckets[where[0]]
        if bucket.store is None:
            bucket.store = torch.empty(bucket.numel, dtype=bucket.params[0].dtype, device=bucket.device)
        if param.dtype != bucket.store.dtype or param.device != bucket.store.device:
            return None
        return bucket.slice(where[1], bucket.store).view_as(param)

    def _comm_dtype(self, p: torch.nn.Parameter) -> torch.dtype:
        """``communication_data_type`` if set, else the ``torch_autocast`` dtype of a lower-precision-safe
        module's parameter, else the dtype the gradient is held in (as DeepSpeed)."""
        return self.settings.comm_dtype or getattr(p, AUTOCAST_COMM_DTYPE_ATTR, None) or self.grad_dtype(p)

    def buffers(self) -> list[torch.Tensor]:
        """The communication buffers allocated right now (pooled, and those of buckets in flight)."""
        pooled = [t for pool in (self._pool, self._staging) for ts in pool.values() for t in ts]
        return pooled + [t for b in self.buckets for t in (b.flat, b.staging) if t is not None]

    # ---- GradientReducer --------------------------------------------------------------------------------
    def grad_ready(self, param: torch.nn.Parameter) -> None:
        """Mark ``param``'s gradient final; send every bucket that is complete, in order."""
        if self.coalescing or param not in self.where:
            return
        b, i = self.where[param]
        if b < self.next_launch:
            raise RuntimeError(f"a gradient of a parameter of shape {tuple(param.shape)} arrived twice in one "
                               "backward pass after it was sent for reduction (a parameter used both inside and "
                               "outside reentrant activation checkpointing?); use use_reentrant=False")
        self.buckets[b].ready.add(i)
        if self.free_grads and b == self.next_launch:
            self._fill(self.buckets[b], i)
        while self.next_launch < len(self.buckets):
            nxt = self.buckets[self.next_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)
            self.next_launch += 1

    def _fill(self, bucket: Bucket, i: int) -> None:
        """Stage 2: copy a gradient into the next bucket's buffer as it lands and free it, so autograd's memory is
        reused by the next layer's gradient instead of going back to the OS and faulting in again every step."""
        if bucket.flat is None:
            if bucket.numel > self.settings.bucket_numel:  # a parameter reduced in its own gradient tensor
                return
            self._make_room()
            bucket.flat = self._acquire(bucket)
        p = bucket.params[i]
        grad = self.get_grad(p)
        if grad is None:
            return  # packed (zeros, or a gradient that arrives later) at launch
        dense = (grad.to_dense() if grad.is_sparse else grad).reshape(-1)
        if i in bucket.filled:  # a second gradient in this backward (reentrant checkpointing): accumulate
            bucket.slice(i).add_(dense)
        else:
            bucket.slice(i).copy_(dense)
            bucket.filled.add(i)
        p.grad = None

    def _make_room(self) -> None:
        """Complete the buckets in flight longest until fewer than the limit (2 with ``overlap_comm``, else 1)
        remain, so at most that many communication buffers are alive."""
        limit = 2 if self.settings.overlap_comm else 1
        while len(self._inflight) >= limit:
            self._complete(self._inflight.popleft())

    def _acquire(self, bucket: Bucket) -> torch.Tensor:
        """A buffer for ``bucket``: from the pool (``contiguous_gradients``), else a fresh one."""
        if not self.settings.contiguous_gradients or bucket.numel > self.settings.bucket_numel:
            return torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        bucket.pooled = True
        pool = self._pool.setdefault((bucket.dtype, bucket.device), [])
        for k, t in enumerate(pool):
            if t.numel() >= bucket.numel:
                return pool.pop(k)[:bucket.numel]
        size = self._pool_sizes()[(bucket.dtype, bucket.device)]
        return torch.empty(size, dtype=bucket.dtype, device=bucket.device)[:bucket.numel]

    def _pool_sizes(self) -> dict[tuple[torch.dtype, torch.device], int]:
        """Per (dtype, device): the largest bucket that packs into a pooled buffer."""
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for b in self.buckets:
            if b.numel <= self.settings.bucket_numel and not b.direct:
                key = (b.dtype, b.device)
                sizes[key] = max(sizes.get(key, 0), b.numel)
        return sizes

    def _staging_sizes(self) -> dict[tuple[torch.dtype, torch.device], int]:
        """Per (dtype, device): the most elements this rank owns of one bucket that packs into a pooled buffer,
        where buckets travel point to point (one peer's copies are received at a time, so the staging never
        outgrows ``reduce_bucket_size``; a larger parameter's exchange gets a fresh one, as its bucket does)."""
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for b in self.buckets:
            if b.numel <= self.settings.bucket_numel and self._uses_exchange(b) and self._own_numel(b):
                key = (b.dtype, b.device)
                sizes[key] = max(sizes.get(key, 0), self._staging_numel(b))
        return sizes

    def _staging_numel(self, bucket: Bucket) -> int:
        """A direct bucket on more than 2 ranks sums into a second half (the first receives the next peer)."""
        own = self._own_numel(bucket)
        return 2 * own if bucket.direct and bucket.channel.world > 2 else own

    def _uses_exchange(self, bucket: Bucket) -> bool:
        s = self.settings
        return s.reduce_scatter and s.use_multi_rank_bucket_allreduce and bucket.channel.p2p

    def _acquire_staging(self, bucket: Bucket) -> torch.Tensor:
        numel = self._staging_numel(bucket)
        pool = self._staging.get((bucket.dtype, bucket.device), []) if self.settings.contiguous_gradients else []
        buf = None
        for k, t in enumerate(pool):
            if t.numel() >= numel:
                bucket.staged = True
                buf = pool.pop(k)[:numel]
                break
        if buf is None:
            buf = torch.empty(numel, dtype=bucket.dtype, device=bucket.device)
        if bucket.direct:
            own = self._own_numel(bucket)
            bucket.acc = buf[own:] if numel > own else buf
            return buf[:own]
        return buf

    def _pack_in_place(self, bucket: Bucket) -> bool:
        """A parameter larger than ``reduce_bucket_size`` is reduced in its own gradient tensor (no copy, no
        buffer of its size), as DeepSpeed does for extra-large parameters."""
        # stage 1 keeps the full gradient after the reduction (a second backward at the boundary adds to it and
        # reduces it again), so only stage 2, which frees it, may reduce it in place
        if not self.free_grads or len(bucket.params) != 1 or bucket.numel <= self.settings.bucket_numel:
            return False
        p = bucket.params[0]
        grad = self.get_grad(p)
        if grad is None or grad.is_sparse or grad.dtype != bucket.dtype or not grad.is_contiguous():
            return False
        bucket.flat = grad.view(-1)
        p.grad = None
        return True

    def _pack(self, bucket: Bucket) -> None:
        """Copy the bucket's gradients (zeros for those without one) into its buffer; stage 2 frees them. A
        direct bucket's buffer is its store, where the gradients already are (a gradient held elsewhere, e.g.
        sparse, is copied in; ``param.grad`` stays as it is)."""
        self._make_room()
        if bucket.direct:
            if bucket.store is None:  # no gradient was kept in a slot (none arrived, or none fitted)
                bucket.store = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
            bucket.flat = bucket.store
        elif bucket.flat is None:
            if self._pack_in_place(bucket):
                return
            bucket.flat = self._acquire(bucket)
        for i, p in enumerate(bucket.params):
            if i in bucket.filled:
                continue
            grad = self.get_grad(p)
            dst = bucket.slice(i)
            if grad is None:
                dst.zero_()
                if i not in bucket.ready:
                    self._unused.append(p)
                continue
            if bucket.direct and not grad.is_sparse and grad.data_ptr() == dst.data_ptr() and grad.is_contiguous():
                continue  # the gradient is its slot of the store
            dst.copy_((grad.to_dense() if grad.is_sparse else grad).reshape(-1))
            if self.free_grads:
                p.grad = None

    def _launch(self, bucket: Bucket) -> None:
        s = self.settings
        if not self._pass_open:
            self._pass_open = True
            if not self.every_micro_step:  # stage 1 reduces the whole accumulated gradient: replace, not add
                for fg in self.groups:
                    if fg.grad_partition_allocated:  # else its first use allocates it zeroed
                        fg.grad_partition.zero_()
        self._pack(bucket)
        flat, channel = bucket.flat, bucket.channel
        pre = self._pre_factor(channel)
        if pre != 1.0:
            flat.mul_(pre)
        if channel.world > 1:
            if s.reduce_scatter and not s.use_multi_rank_bucket_allreduce:
                bucket.works = self._reduce_to_owners(bucket)
            elif self._uses_exchange(bucket):  # gloo: faster point to point than by all-reduce
                bucket.works = self._exchange(bucket)
            else:
                bucket.works = [self.comm.all_reduce(flat, group=channel.group, async_op=True)]
        self._inflight.append(bucket)
        if not s.overlap_comm:
            self._complete(self._inflight.popleft())

    def _owner_runs(self, bucket: Bucket) -> list[tuple[int, int, int]]:
        """``(owner rank, start in bucket, numel)`` of the bucket's pieces, merged when contiguous (cached: the
        layout is fixed)."""
        if bucket.runs is None:
            runs: list[tuple[int, int, int]] = []
            for i, p in enumerate(bucket.params):
                g, j = self.home[p]
                for owner, frag in self.groups[g].layout.owners(j):
                    start = bucket.offsets[i] + frag.tensor_offset
                    if runs and runs[-1][0] == owner and runs[-1][1] + runs[-1][2] == start:
                        runs[-1] = (owner, runs[-1][1], runs[-1][2] + frag.numel)
                    else:
                        runs.append((owner, start, frag.numel))
            bucket.runs = runs
        return bucket.runs

    def _reduce_to_owners(self, bucket: Bucket) -> list[Any]:
        works, channel = [], bucket.channel
        for owner, start, numel in self._owner_runs(bucket):
            works.append(self.comm.reduce(bucket.flat[start:start + numel], dst=channel.peer(owner),
                                          group=channel.group, async_op=True))
        return works

    def _own_runs(self, bucket: Bucket) -> list[tuple[int, int, int]]:
        """The runs of ``_owner_runs`` this rank owns."""
        return [run for run in self._owner_runs(bucket) if run[0] == bucket.channel.rank]

    def _own_numel(self, bucket: Bucket) -> int:
        return sum(numel for _, _, numel in self._own_runs(bucket))

    def _exchange(self, bucket: Bucket) -> list[Any]:
        """Point-to-point reduce-scatter: each rank sends the other owners their pieces and receives every
        rank's copy of its own into its staging buffer, one peer at a time, summed in ``_complete`` (gloo: 0.69x
        the time of an all-reduce of the bucket)."""
        channel = bucket.channel
        sends = [dist.P2POp(dist.isend, bucket.flat[start:start + numel], channel.peer(owner), channel.group)
                 for owner, start, numel in self._owner_runs(bucket) if owner != channel.rank]
        if not self._own_numel(bucket):
            return self.comm.batch_isend_irecv(sends) if sends else []
        bucket.staging = self._acquire_staging(bucket)
        bucket.pending = [r for r in range(channel.world) if r != channel.rank]
        receives = self._receive_ops(bucket, bucket.pending.pop(0))
        if not bucket.pending:  # two ranks: one batch, waited for whole before the sum
            bucket.receives = self.comm.batch_isend_irecv(sends + receives)
            return []
        # more ranks: a rank waits only for receives before posting the next peer's, never for its sends (gloo
        # holds a send until its receive is posted, which a peer does only after its own earlier receives)
        bucket.receives = self.comm.batch_isend_irecv(receives)
        return self.comm.batch_isend_irecv(sends) if sends else []

    def _receive_ops(self, bucket: Bucket, rank: int) -> list[dist.P2POp]:
        """Receives of channel rank ``rank``'s copies of this rank's pieces, into the staging buffer."""
        channel, ops, at = bucket.channel, [], 0
        for _, _, numel in self._own_runs(bucket):
            ops.append(dist.P2POp(dist.irecv, bucket.staging[at:at + numel], channel.peer(rank), channel.group))
            at += numel
        return ops

    def _sum_received(self, bucket: Bucket) -> None:
        """Add every peer's copy into this rank's pieces, in rank order (every rank's sum rounds the same way);
        a peer's copies are received once the previous peer's are added (the sends were all posted at launch, so
        no rank waits on a receive that is not yet posted). A direct bucket's sums go to ``acc`` (same operands,
        same order: the same bytes), leaving its store as it was."""
        first = True
        while True:
            for work in bucket.receives:
                work.wait()
            at = 0
            for _, start, numel in self._own_runs(bucket):
                mine, theirs = bucket.flat[start:start + numel], bucket.staging[at:at + numel]
                if not bucket.direct:
                    mine.add_(theirs)
                elif first:
                    torch.add(mine, theirs, out=bucket.acc[at:at + numel])
                else:
                    bucket.acc[at:at + numel].add_(theirs)
                at += numel
            first = False
            if not bucket.pending:
                break
            bucket.receives = self.comm.batch_isend_irecv(self._receive_ops(bucket, bucket.pending.pop(0)))
        bucket.receives = []

    def _release_staging(self, bucket: Bucket) -> None:
        """Return the staging buffer (and a direct bucket's ``acc``, which lives in it) once its sums are read."""
        if bucket.staged:
            base = bucket.staging._base if bucket.staging._base is not None else bucket.staging
            self._staging.setdefault((bucket.dtype, bucket.device), []).append(base)
        bucket.staging, bucket.staged, bucket.acc = None, False, None

    def _complete(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s collective, add this rank's slices into the partitions, release the buffer."""
        if bucket.staging is not None:
            self._sum_received(bucket)
        for work in bucket.works:
            work.wait()
        bucket.works = []
        s = self.settings
        post = 1.0 if s.prescale_gradients or not s.average else s.gradient_predivide_factor / bucket.channel.divisor
        if post != 1.0:  # only this rank's pieces are read after the reduction
            if bucket.acc is not None:
                bucket.acc.mul_(post)
            else:
                for _, start, numel in self._own_runs(bucket):
                    bucket.flat[start:start + numel].mul_(post)
        self._write_back(bucket)
        self._release_staging(bucket)
        if bucket.pooled:
            base = bucket.flat._base if bucket.flat._base is not None else bucket.flat
            self._pool.setdefault((bucket.dtype, bucket.device), []).append(base)
        bucket.flat, bucket.pooled = None, False
        bucket.ready.clear()
        bucket.filled.clear()

    def finish(self) -> None:
        """Send what is left, wait, add this rank's slices into the gradient partitions."""
        if self.coalescing:
            self._pending_flush = True
            return
        for bucket in self.buckets[self.next_launch:]:
            self._launch(bucket)
        self.next_launch = 0
        while self._inflight:
            self._complete(self._inflight.popleft())
        self.reduced = True
        self._pass_open = False
        unused, self._unused = self._unused, []
        if self.every_micro_step and not self.settings.ignore_unused_parameters:
            self._check_unused(unused)

    def _check_unused(self, unused: list[torch.nn.Parameter]) -> None:
        """Raise on every rank when any rank had unused parameters (one rank raising alone would leave the
        others waiting in their next collective)."""
        count = torch.tensor([float(len(unused))], device=self.buckets[0].device if self.buckets else "cpu")
        if self.world > 1:
            self.comm.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        if count.item() > 0:
            here = (f"{len(unused)} parameter(s) of shapes {[tuple(p.shape) for p in unused[:5]]} received no "
                    "gradient on this rank" if unused else "another rank had parameters without a gradient")
            raise UnusedParametersError(f"ZeRO stage 2: {here} in this backward; set zero_optimization."
                                        "ignore_unused_parameters to true to allow unused parameters")

    def _own_slices(self, bucket: Bucket) -> list[tuple[int, int, int, int]]:
        """``(group, partition offset, bucket offset, numel)`` of the pieces this rank owns (cached: the layout
        is fixed, and this runs after every bucket's reduction)."""
        if bucket.own is None:
            bucket.own = []
            for i, p in enumerate(bucket.params):
                g, j = self.home[p]
                fg = self.groups[g]
                bucket.own.extend((g, frag.partition_offset, bucket.offsets[i] + frag.tensor_offset, frag.numel)
                                  for owner, frag in fg.layout.owners(j) if owner == fg.rank)
        return bucket.own

    def _write_back(self, bucket: Bucket) -> None:
        dsts, srcs = [], []
        at = 0  # a direct bucket's sums: this rank's pieces back to back in ``acc``, in bucket order
        for g, part_offset, offset, numel in self._own_slices(bucket):
            dsts.append(self.groups[g].grad_partition.narrow(0, part_offset, numel))
            srcs.append(bucket.flat.narrow(0, offset, numel) if bucket.acc is None else bucket.acc.narrow(0, at, numel))
            at += numel
        if not dsts:
            return
        if all(d.dtype == s.dtype for d, s in zip(dsts, srcs, strict=True)):
            torch._foreach_add_(dsts, srcs)
        else:
            for d, s in zip(dsts, srcs, strict=True):
                d.add_(s)

    # ---- coalesce_grad_reduction ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def coalesce(self) -> Iterator[None]:
        """One reduction for every backward inside the block, at its end (gradients stay in ``.grad`` until
        then). Stage 1 flushes only when a boundary backward ran inside the block."""
        if self.coalescing:
            raise RuntimeError("coalesce_grad_reduction() cannot be nested")
        self.coalescing, self._pending_flush = True, False
        try:
            yield
        finally:
            self.coalescing = False
        if self._pending_flush:
            self._pending_flush = False
            for p in self.params:
                self.grad_ready(p)
            self.finish()

    def reset(self) -> None:
        """Start a new accumulation window (called by the optimizer's ``zero_grad``)."""
        self.reduced = False
