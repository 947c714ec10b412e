"""ZeRO-Infinity's parameter swapper: the 16-bit partitions (``ds_tensor``) of ZeRO-3 parameters live in one
file each under ``nvme_path`` and are read into CPU buffers only around their all-gather.

A swapped-out partition is a ``meta`` tensor of the right size and dtype (so ``ds_tensor.numel()`` keeps
answering, and any read of its data raises instead of returning stale values); ``swap_in`` makes it a view of a
buffer again. Reads come from a bounded :class:`BufferPool` (``buffer_count`` buffers of up to ``buffer_size``
elements); ``prefetch`` starts them ahead of use (the ZeRO-3 scheduler calls it with the parameters its trace
says come next) and never takes more than the pool holds. A gather that needs more partitions at once than the
pool has (gathering a whole model for a checkpoint) uses temporary buffers for the rest. ``max_in_cpu``
elements of partitions stay in CPU memory and are never swapped. Updated partitions are written through at
once, so the file is always the current value.

Ownership of the buffers (the rule of :mod:`ds_zero.swap.buffer_pool`, checked by the pool): a buffer taken by
``prefetch`` or ``swap_in`` belongs to one partition. While its read is in flight (``reading``) nothing may
use it: ``swap_in``, ``write`` and ``release_all`` first wait for the reader, and only a waited-for read
makes the partition ``resident``, whose buffer ``install`` may then point ``ds_tensor`` at (checked). It goes
back to the pool when the partition is released, or after a failed read only once the reader was waited for.
Writes never go from a pool buffer: their source (``value``) is kept referenced until ``flush`` waits for the
writer, and a second write of one file first flushes the one in flight.

Every read is checked against the CRC32 of what was written to that file (:mod:`ds_zero.swap._checksum`)
after the reader's wait, before the partition becomes resident; a mismatch fails the batch as a failed read does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ds_ops.aio import AioError, page_aligned_empty
from ds_zero.swap._checksum import SwapChecksums, SwapCorruptionError
from ds_zero.swap._folder import annotate, cleanup_on_exit, close_handles, make_swap_folder, new_handle
from ds_zero.swap.buffer_pool import BufferPool


@dataclass(frozen=True)
class ParamSwapSettings:
    """``offload_param`` with ``device: nvme`` (and the ``aio`` section)."""

    nvme_path: str
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    pin_memory: bool = False
    aio: Any = None


def is_swapped(param: Any) -> bool:
    """Whether ``param``'s partition lives on NVMe (resident or not)."""
    return getattr(param, "ds_swapper", None) is not None


class ParamSwapper:
    """Partitions of ``rank``'s parameters on NVMe."""

    def __init__(self, settings: ParamSwapSettings, rank: int) -> None:
        self.settings = settings
        self.folder = make_swap_folder(settings.nvme_path, "params", rank, "offload_param.nvme_path")
        self._cleanup = cleanup_on_exit(self, self.folder)
        self.reader, self.writer = new_handle(settings.aio), new_handle(settings.aio)
        self._pools: dict[torch.dtype, BufferPool] = {}
        self.in_cpu_numel = 0
        self.largest = 0
        self.resident: dict[int, tuple[Any, torch.Tensor]] = {}  # ds_id -> (param, buffer), read done
        self.reading: dict[int, tuple[Any, torch.Tensor]] = {}  # ds_id -> (param, buffer), read in flight
        self._writes: list[torch.Tensor] = []  # sources of writes in flight (kept alive until flush)
        self._on_disk: dict[int, int] = {}  # ds_id -> bytes of its file: rewrites of that size go in place
        self._writing: set[int] = set()  # ds_ids with a write in flight
        self.read_bytes = self.write_bytes = 0
        self.checksums = SwapChecksums(rank)

    def path(self, param: Any) -> str:
        return os.path.join(self.folder, f"{param.ds_id}_param.tensor.swp")

    def _pool(self, dtype: torch.dtype) -> BufferPool:
        if dtype not in self._pools:  # at first use, sized to the largest partition (at most buffer_size)
            numel = max(1, min(self.settings.buffer_size, self.largest))
            self._pools[dtype] = BufferPool(max(1, self.settings.buffer_count), numel, dtype,
                                            self.settings.pin_memory, key="offload_param.buffer_count")
        return self._pools[dtype]

    # ---- adoption -------------------------------------------------------------------------------------------
    def adopt(self, param: Any) -> None:
        """Take ``param``'s partition: kept in CPU memory while ``max_in_cpu`` allows, else written to its
        file and dropped from memory."""
        if is_swapped(param):
            return
        part = param.ds_tensor
        numel = part.numel()
        if numel > self.settings.buffer_size:
            raise ValueError(f"offload_param.buffer_size={self.settings.buffer_size} elements is smaller than the "
                             f"partition of a parameter of shape {tuple(param.ds_shape)} ({numel} elements on this "
                             f"rank); raise buffer_size to at least {numel}")
        if self.in_cpu_numel + numel <= self.settings.max_in_cpu:
            self.in_cpu_numel += numel
            param.ds_tensor = part.detach().to("cpu")  # stays in CPU memory for good
            param.ds_tensor.ds_numel = numel
            return
        self.largest = max(self.largest, numel)
        param.ds_swapper = self
        self._write(param, part.detach().to("cpu").contiguous(), wait=True)
        self._drop(param)

    def _drop(self, param: Any) -> None:
        placeholder = torch.empty(param.ds_tensor.numel(), dtype=param.ds_tensor.dtype, device="meta")
        placeholder.ds_numel = placeholder.numel()
        param.ds_tensor = placeholder

    # ---- reads ----------------------------------------------------------------------------------------------
    def prefetch(self, params: list[Any]) -> int:
        """Start reading the partitions of ``params`` that are on NVMe only, while pool buffers are free;
        returns how many reads started."""
        started = 0
        for p in params:
            if not is_swapped(p) or p.ds_id in self.resident or p.ds_id in self.reading:
                continue
            pool = self._pool(p.ds_tensor.dtype)
            if p.ds_tensor.numel() > pool.numel:
                continue
            buffer = pool.get()
            if buffer is None:
                break
            self._start_read(p, buffer)
            started += 1
        return started

    def swap_in(self, params: list[Any]) -> None:
        """Make every swapped partition of ``params`` resident (waiting for prefetched reads)."""
        todo = [p for p in params if is_swapped(p) and p.ds_id not in self.resident]
        for p in todo:
            if p.ds_id not in self.reading:
                pool = self._pool(p.ds_tensor.dtype)
                buffer = pool.get() if p.ds_tensor.numel() <= pool.numel else None
                if buffer is None:  # more at once than the pool holds: a temporary buffer
                    buffer = page_aligned_empty(p.ds_tensor.numel(), p.ds_tensor.dtype)
                self._start_read(p, buffer)
        if self.reading:
            self._wait_reads()
        self.install(params)

    def _start_read(self, param: Any, buffer: torch.Tensor) -> None:
        view = buffer.narrow(0, 0, param.ds_tensor.numel())
        pool = self._pools.get(view.dtype)
        if pool is not None:  # a temporary buffer (not the pool's) is not tracked
            pool.begin(view, self.reader, f"read of parameter partition {param.ds_id}")
        try:
            self.reader.async_pread(view, self.path(param))
        except AioError as exc:
            if pool is not None and pool.owns(buffer):  # refused at submission: nothing in flight, buffer unused
                pool.abort(view)
                pool.put(buffer)
            raise annotate(exc, f"swap in parameter partition {param.ds_id} (shape {tuple(param.ds_shape)})") \
                from None
        self.reading[param.ds_id] = (param, buffer)
        self.read_bytes += view.numel() * view.element_size()
        param.ds_swap_view = view

    def _wait_reads(self) -> None:
        try:
            self.reader.wait()
            for param, _ in self.reading.values():
                self.checksums.verify(self.path(param), param.ds_swap_view,
                                      what=f"swap in parameter partition {param.ds_id}")
        except AioError as exc:
            self._settle_reads()
            # none of the buffers read in this batch may be installed later as if it held the partition: they go
            # back to the pool and the partitions stay on NVMe only (a retry reads them again)
            failed, self.reading = list(self.reading.values()), {}
            for param, buffer in failed:
                self._give_back(param, buffer)
            if isinstance(exc, SwapCorruptionError):
                raise
            raise annotate(exc, "swap in parameter partitions") from None
        self._settle_reads()
        self.resident.update(self.reading)
        self.reading.clear()

    def _settle_reads(self) -> None:
        for pool in self._pools.values():
            pool.settle(self.reader)

    def install(self, params: list[Any]) -> None:
        """Point the ``ds_tensor`` of resident partitions at their buffers (after ``swap_in``)."""
        for p in params:
            if is_swapped(p) and p.ds_id in self.resident:
                view = p.ds_swap_view
                pool = self._pools.get(view.dtype)
                if pool is not None:
                    pool.check_ready([view])
                view.ds_numel = view.numel()
                p.ds_tensor = view

    def release(self, params: list[Any]) -> None:
        """Drop the resident copies of ``params`` (the files hold the values); buffers go back to the pool."""
        for p in params:
            entry = self.resident.pop(p.ds_id, None) if is_swapped(p) else None
            if entry is not None:
                self._give_back(*entry)

    def _give_back(self, param: Any, buffer: torch.Tensor) -> None:
        pool = self._pools.get(param.ds_tensor.dtype)
        if pool is not None and pool.owns(buffer):
            pool.put(buffer)
        self._drop(param)
        param.ds_swap_view = None

    def read_copy(self, param: Any) -> torch.Tensor:
        """The current partition in new memory (resident or not)."""
        if not is_swapped(param):
            return param.ds_tensor.detach().clone()
        if param.ds_id in self.resident:
            return param.ds_swap_view.clone()
        out = torch.empty(param.ds_tensor.numel(), dtype=param.ds_tensor.dtype)
        try:
            self.reader.sync_pread(out, self.path(param))
        except AioError as exc:
            raise annotate(exc, f"read parameter partition {param.ds_id}") from None
        self.checksums.verify(self.path(param), out, what=f"read parameter partition {param.ds_id}")
        self.read_bytes += out.numel() * out.element_size()
        return out

    def convert(self, param: Any, dtype: torch.dtype) -> None:
        """Rewrite the partition in ``dtype`` (the engine trains in another dtype than ``zero.Init`` built)."""
        value = self.read_copy(param).to(dtype)
        self.release([param])
        placeholder = torch.empty(value.numel(), dtype=dtype, device="meta")
        placeholder.ds_numel = value.numel()
        param.ds_tensor = placeholder
        self._write(param, value, wait=True)

    # ---- writes ---------------------------------------------------------------------------------------------
    def write(self, param: Any, value: torch.Tensor, wait: bool = True) -> None:
        """``value`` (the partition's elements, any dtype) becomes the partition: written to the file (and to
        the resident copy). ``wait=False`` leaves the write in flight until :meth:`flush`: ``value`` itself may be
        the write's source (when it is already a contiguous CPU tensor of the partition's dtype), so it must not
        change before then."""
        value = value.detach().reshape(-1).to("cpu", param.ds_tensor.dtype).contiguous()
        if param.ds_id in self.reading:  # a read started before this write would install the old value
            self._wait_reads()
        if param.ds_id in self.resident:
            param.ds_swap_view.copy_(value)
        self._write(param, value, wait)

    def _write(self, param: Any, value: torch.Tensor, wait: bool) -> None:
        nbytes = value.numel() * value.element_size()
        # the first write creates the file whole; later ones of the same size overwrite it (no create, reserve
        # and rename per write: see ds_zero.swap.optimizer_swapper)
        in_place = self._on_disk.get(param.ds_id) == nbytes
        if param.ds_id in self._writing:  # two in-place writes of one file in flight could interleave blocks
            self.flush()
        self.checksums.record(self.path(param), value)
        try:
            self.writer.async_pwrite(value, self.path(param), whole_file=not in_place)
        except AioError as exc:
            raise annotate(exc, f"swap out parameter partition {param.ds_id}") from None
        self._on_disk[param.ds_id] = nbytes
        self.write_bytes += nbytes
        self._writes.append(value)
        self._writing.add(param.ds_id)
        if wait:
            self.flush()

    def flush(self) -> None:
        """Wait for the writes in flight."""
        try:
            self.writer.wait()
        except AioError as exc:
            raise annotate(exc, "swap out parameter partitions") from None
        finally:
            self._writes.clear()
            self._writing.clear()

    def release_all(self) -> None:
        """Drop every resident or prefetched partition (end of a pass: a stale prefetch must not hold buffers)."""
        if self.reading:
            self._wait_reads()
        for param, buffer in list(self.resident.values()):
            self._give_back(param, buffer)
        self.resident.clear()

    def close(self) -> None:
        close_handles(self.reader, self.writer)
        for pool in self._pools.values():
            pool.close()
        self._pools = {}
        self._cleanup()
