"""Reduce-scatter of ZeRO-3 gradients into the partitions, during backward (the engine's ``GradientReducer``).

Parameters are grouped into fixed buckets of about ``reduce_bucket_size`` elements in reverse model order (the
order backward produces gradients). As each gradient lands it is packed into its bucket's ``[W, B]`` buffer
(row ``r`` holds rank ``r``'s slices of every gradient in the bucket, each parameter padded as its partition
is) and the whole gradient is freed. A full bucket is reduce-scattered, strictly in bucket order so every rank
issues the same collectives: on gloo with up to four ranks point to point (each rank sends row ``r`` to rank
``r`` and sums the rows it receives, as stage 1/2 do), otherwise ``reduce_scatter_tensor``. With
``overlap_comm`` up to two buckets are in flight while backward goes on. The averaged row is added into the
owning optimizer group's gradient partition, so gradients accumulate across micro-steps. At the end of
backward the remaining buckets (gradients that never arrived count as zeros) are sent and the scheduler's
pass ends (every gathered parameter is released).

MiCS and ZeRO++ (``configure_zeropp``): with qgZ a bucket's exchange is the quantized two-hop all-to-all of
``ds_zero.zeropp.qgz`` instead; with MiCS (the group is a shard group) each reduced row is then all-reduced across
the shard group's replicas and averaged over all of them.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ds_zero.gather import P2P_MAX_WORLD
from ds_zero.stage_1_and_2 import ReduceSettings
from ds_zero.zeropp.exchange import all_reduce_sum
from ds_zero.zeropp.traffic import record

_POOL = 2  # freed buffers kept for reuse: one bucket's [W, B] buffer and its receive rows (~2 x reduce_bucket_size)


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter], world: int) -> None:
        self.params = params
        self.columns = []
        total = 0
        for p in params:
            self.columns.append(total)
            total += p.ds_tensor.numel()
        self.width = total
        self.world = world
        self.buffer: torch.Tensor | None = None
        self.ready: set[int] = set()
        self.works: list[Any] = []
        self.received: torch.Tensor | None = None
        self.result: torch.Tensor | None = None


class ReduceScatter:
    """Averages gradients over the data-parallel group into ``add_to_partition(param, averaged_slice)``."""

    every_micro_step = True
    reduced = True  # gradients live in the partitions from the first backward on (the safe_* APIs read them)

    def __init__(self, params: list[torch.nn.Parameter], add_to_partition: Callable, settings: ReduceSettings,
                 comm: Any, group: Any, world: int, rank: int, comm_dtype: torch.dtype,
                 end_pass: Callable[[], None], average_over: int | None = None) -> None:
        self.settings, self.comm, self.group = settings, comm, group
        self.world, self.rank = world, rank
        # the divisor of the summed gradient: the group's size, or the data-parallel size for parameters
        # partitioned over a smaller group (AutoEP experts: averaged over every token of the batch)
        self.average_over = average_over or world
        self.comm_dtype = comm_dtype
        self.add_to_partition = add_to_partition
        self.end_pass = end_pass
        self.buckets = self._make_buckets(list(reversed(params)), max(1, settings.bucket_numel))
        self.where = {id(p): (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)}
        self.next_to_send = 0
        self.in_flight: collections.deque[_Bucket] = collections.deque()
        self.p2p = world > 1 and dist.get_backend(group) == "gloo" and world <= P2P_MAX_WORLD
        self.coalescing = False
        self.micro_steps = 0  # reductions into the partitions since the window began (DeepSpeed's micro_step_id)
        # freed bucket and receive buffers, reused by the next bucket: a fresh tensor per bucket and step costs its
        # allocation and, on the CPU, the first-touch page faults of every byte (15 ms of an MLP step)
        self._pool: list[torch.Tensor] = []
        self.replica: Any = None  # MiCS: the replicas of this rank's shard (a SubGroup), summed after the reduce
        self.qgz: Any = None  # ZeRO++ qgZ: a QuantizedReduce doing the reduce-scatter as a quantized all-to-all

    def configure_zeropp(self, replica: Any = None, qgz: Any = None) -> None:
        """MiCS: ``replica`` (the ranks holding this rank's shard in the other shard groups, a ``SubGroup``) gets
        each reduced row all-reduced across it, and the average is over shard group x replicas. qgZ: ``qgz``
        (``ds_zero.zeropp.qgz.QuantizedReduce``) replaces the exchange."""
        self.replica, self.qgz = replica, qgz

    def _make_buckets(self, params: list[torch.nn.Parameter], limit: int) -> list[_Bucket]:
        buckets, current, size = [], [], 0
        for p in params:
            current.append(p)
            size += p.ds_tensor.numel() * self.world
            if size >= limit:
                buckets.append(_Bucket(current, self.world))
                current, size = [], 0
        if current:
            buckets.append(_Bucket(current, self.world))
        return buckets

    # ---- the engine's GradientReducer ------------------------------------------------------------------------
    def grad_ready(self, param: torch.nn.Parameter) -> None:
        found = self.where.get(id(param))
        if found is None or param.grad is None:
            return
        b, i = found
        bucket = self.buckets[b]
        if b < self.next_to_send:  # a second gradient after its bucket left (reentrant checkpointing runs nested
            # backward passes): it travels alone, right away; every rank sees the same order, so the same exchange
            late = _Bucket([param], self.world)
            self._pack(late, 0, param.grad)
            param.grad = None
            late.ready.add(0)
            self._send(late)
            return
        self._pack(bucket, i, param.grad)
        param.grad = None  # the whole gradient is not kept: its slice travels in the bucket
        bucket.ready.add(i)
        while not self.coalescing and self.next_to_send < len(self.buckets) and \
                len(self.buckets[self.next_to_send].ready) == len(self.buckets[self.next_to_send].params):
            self._send(self.buckets[self.next_to_send])
            self.next_to_send += 1

    def finish(self) -> None:
        """Send what is left (missing gradients are zeros), wait for everything, end the scheduler's pass."""
        if not self.coalescing:
            while self.next_to_send < len(self.buckets):
                self._send(self.buckets[self.next_to_send])
                self.next_to_send += 1
            while self.in_flight:
                self._complete(self.in_flight.popleft())
            self._rewind()
            self.micro_steps += 1
        self.end_pass()

    def reset(self) -> None:
        """A new accumulation window (the optimizer's ``zero_grad``): the next reduction is micro-step 0."""
        self._rewind()
        self.micro_steps = 0

    def _rewind(self) -> None:
        self.next_to_send = 0
        for bucket in self.buckets:
            bucket.ready.clear()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Backward calls inside send nothing: their gradients add up in the buckets until ``finish()``."""
        if self.coalescing:
            raise RuntimeError("coalesce_grad_reduction() cannot be nested")
        self.coalescing = True
        try:
            yield
        finally:
            self.coalescing = False

    @contextlib.contextmanager
    def coalesce(self) -> Iterator[None]:
        """Several backward calls, one reduction: buckets fill across them and go out when the block ends."""
        with self.hold():
            yield
        self.finish()

    def buffers(self) -> list[torch.Tensor]:
        """Communication buffers currently allocated (``offload_states``' contiguous_grad_buffer)."""
        return [b.buffer for b in self.buckets if b.buffer is not None] + list(self._pool)

    def _take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        for k, t in enumerate(self._pool):
            if t.numel() >= numel and t.dtype == dtype and t.device == device:
                return self._pool.pop(k)[:numel]
        return torch.empty(numel, dtype=dtype, device=device)

    def _give(self, t: torch.Tensor | None) -> None:
        if t is not None:
            base = t if t._base is None else t._base
            self._pool.append(base.reshape(-1))
            self._pool.sort(key=torch.Tensor.numel)
            while len(self._pool) > _POOL:
                self._pool.pop(0)  # keep the largest

    # ---- buckets ---------------------------------------------------------------------------------------------
    def _buffer(self, bucket: _Bucket, device: torch.device) -> torch.Tensor:
        if bucket.buffer is None:  # not zeroed: _send zeroes the columns no gradient was packed into
            bucket.buffer = self._take(self.world * bucket.width, self.comm_dtype, device).view(self.world,
                                                                                                 bucket.width)
        return bucket.buffer

    def _pack(self, bucket: _Bucket, i: int, grad: torch.Tensor) -> None:
        p = bucket.params[i]
        part = p.ds_tensor.numel()
        grad = grad.to_dense() if grad.is_sparse else grad
        buf = self._buffer(bucket, grad.device)
        flat = grad.reshape(-1)
        padded = self.world * part
        if flat.numel() != padded:
            flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
        region = buf.narrow(1, bucket.columns[i], part)
        if i in bucket.ready:  # coalesced backward calls: a second gradient for the same window adds up
            region.add_(flat.view(self.world, part))
        else:
            region.copy_(flat.view(self.world, part))

    def _send(self, bucket: _Bucket) -> None:
        if bucket.buffer is None:  # no gradient reached this bucket on this rank: zeros still take part
            device = bucket.params[0].ds_space.compute_device
            self._buffer(bucket, device)
        buf = bucket.buffer
        for i, p in enumerate(bucket.params):
            if i not in bucket.ready:  # no gradient on this rank (unused parameter): zeros take part
                buf.narrow(1, bucket.columns[i], p.ds_tensor.numel()).zero_()
        if self.settings.prescale_gradients:
            buf.div_(self.settings.gradient_predivide_factor)
        if self.world == 1:
            bucket.result = buf[0]
        elif self.qgz is not None:  # synchronous: the hops dequantize and sum between exchanges
            bucket.result = self.qgz.reduce(buf, key=id(bucket) if bucket in self.buckets else None)
        elif self.p2p:
            bucket.received = self._take((self.world - 1) * bucket.width, buf.dtype, buf.device).view(
                self.world - 1, bucket.width)
            ops, k = [], 0
            for r in range(self.world):
                if r == self.rank:
                    continue
                peer = dist.get_global_rank(self.group, r) if self.group is not None else r
                ops.append(dist.P2POp(dist.isend, buf[r], peer, self.group))
                ops.append(dist.P2POp(dist.irecv, bucket.received[k], peer, self.group))
                k += 1
            bucket.works = list(self.comm.batch_isend_irecv(ops))
            record("grad_reduce", (self.world - 1) * bucket.width * buf.element_size())
        else:
            bucket.result = torch.empty(bucket.width, dtype=buf.dtype, device=buf.device)
            # deepspeed.comm's reduce_scatter_fn where the engine hands it in (DeepSpeed's ZeRO-3 entry point)
            reduce_scatter = getattr(self.comm, "reduce_scatter_fn", None) or \
                getattr(self.comm, "reduce_scatter_tensor", dist.reduce_scatter_tensor)
            bucket.works = [reduce_scatter(bucket.result, buf.reshape(-1), group=self.group, async_op=True)]
            record("grad_reduce", (self.world - 1) * bucket.width * buf.element_size())
        self.in_flight.append(bucket)
        limit = 2 if self.settings.overlap_comm else 0
        while len(self.in_flight) > limit:
            self._complete(self.in_flight.popleft())

    def _complete(self, bucket: _Bucket) -> None:
        for work in bucket.works:
            work.wait()
        if bucket.received is not None:
            result = bucket.buffer[self.rank]  # summed in place: the buffer goes back to the pool below
            for row in bucket.received:
                result.add_(row)
            self._give(bucket.received)
            bucket.received = None
        else:
            result = bucket.result
        world = self.average_over
        if self.replica is not None and self.replica.world > 1:  # MiCS: the shard's sum over every shard group
            all_reduce_sum(result, self.replica.group, self.replica.world, self.comm, "grad_replica")
            world *= self.replica.world
        if self.settings.prescale_gradients:
            result.mul_(self.settings.gradient_predivide_factor / world)
        else:
            result.div_(world)
        for i, p in enumerate(bucket.params):
            self.add_to_partition(p, result.narrow(0, bucket.columns[i], p.ds_tensor.numel()))
        # back to the pool, not kept by the bucket: one buffer per bucket would hold a whole model's gradients
        self._give(bucket.buffer)
        bucket.works, bucket.result, bucket.buffer = [], None, None
