"""ZeRO-Infinity's optimizer swapper: the fp32 master and optimizer states of each swapped sub-group live in
per-tensor files on NVMe (``<sub-group>_<state>.tensor.swp``) and visit CPU memory only for their step.

``run`` streams the sub-groups through a bounded :class:`BufferPool` of ``buffer_count`` buffers of the largest
sub-group's size: with ``pipeline_read`` the next sub-group is read while the current one steps, with
``pipeline_write`` the previous one is written back meanwhile (two aio handles, so each ``wait`` covers one
direction). A sub-group needs one buffer per tensor it keeps (master + states: 3 for Adam); pipelining uses
further buffers only when the pool has them, so a small pool degrades to the sequential order, never grows.

A tensor's first write creates its file (a fresh file, reserved, renamed into place); later writes of the same
size overwrite it in place. Re-creating the file for every write cost a third of the write bandwidth on ext4
(create + fallocate + rename and the freed old extents, per tensor); the price is that a write failing midway
leaves that file partly new, which is harmless as the failed step raises and its sub-groups are not read back
as a consistent state.

Ownership of the buffers (the rule of :mod:`ds_zero.swap.buffer_pool`, checked by the pool). A sub-group's
buffers (master, each state, gradient) are taken by ``run`` for that sub-group alone. Read into: they are in
flight on the *reader* until the reader's wait at the top of that sub-group's turn; only then does ``step``
see them (checked), and the next sub-group's prefetch starts only after that wait, so one reader wait never
has to cover a read the step is not yet allowed to use. Written back: they are in flight on the *writer*
until ``_finish_write`` waits for it, and only then go back to the pool; a prefetch that lacks buffers first
finishes that write. The tensors ``step`` returns must be its own buffers (or new memory, kept referenced
until the write is waited for). ``fast_init`` writes each master from a pool buffer that returns to the pool
only after the writer's wait. The gradient file is read and written synchronously (no buffer of the pool).
After a failure every handle is waited for before the buffers are reclaimed.

Every read is checked against the CRC32 of what was written to that file (:mod:`ds_zero.swap._checksum`): a
sub-group's buffers are verified right after the reader's wait, before ``step`` may see them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ds_ops.aio import AioError
from ds_zero.swap._checksum import SwapChecksums
from ds_zero.swap._folder import annotate, cleanup_on_exit, close_handles, make_swap_folder, new_handle
from ds_zero.swap.buffer_pool import BufferPool

MASTER = "master"
GRAD = "grad"  # the sub-group's gradient partition: written as gradients arrive, read for the step only
StepFn = Callable[[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
_Writing = tuple[list[torch.Tensor], dict[str, torch.Tensor], int]


@dataclass(frozen=True)
class OptimizerSwapSettings:
    """``offload_optimizer`` with ``device: nvme`` (and the ``aio`` section)."""

    nvme_path: str
    buffer_count: int = 4
    pin_memory: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = 1.0
    aio: Any = None


class SwapStats:
    """Bytes moved and seconds spent blocked on them, per direction (for the benchmark's bandwidth). Only
    bytes whose whole transfer was waited for are counted (``fast_init``'s overlapped master writes are not);
    the gradient file's piecewise I/O during the backward pass counts apart (``grad_*``)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (the benchmark measures one step's swaps)."""
        self.read_bytes = self.write_bytes = self.grad_read_bytes = self.grad_write_bytes = 0
        self.read_s = self.write_s = self.grad_read_s = self.grad_write_s = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("read_bytes", "write_bytes", "read_s", "write_s", "grad_read_bytes",
                                              "grad_write_bytes", "grad_read_s", "grad_write_s")}


class OptimizerSwapper:
    """Swap files of ``rank``'s sub-groups; ``largest_numel`` sizes the pool's buffers (fp32 elements)."""

    def __init__(self, settings: OptimizerSwapSettings, rank: int, largest_numel: int) -> None:
        self.settings = settings
        self.folder = make_swap_folder(settings.nvme_path, "optimizer", rank, "offload_optimizer.nvme_path")
        self._cleanup = cleanup_on_exit(self, self.folder)
        self.reader, self.writer = new_handle(settings.aio), new_handle(settings.aio)
        self.largest = max(1, largest_numel)
        self._pool: BufferPool | None = None
        self.names: dict[int, list[str]] = {}  # sub-group -> tensors on disk (master first)
        self.numels: dict[int, int] = {}
        self.grads: set[int] = set()  # sub-groups whose gradient partition is on NVMe too
        self.stats = SwapStats()
        self.checksums = SwapChecksums(rank)
        self._unverified: list[tuple[str, torch.Tensor, str]] = []  # reads in flight on the reader

    @property
    def pool(self) -> BufferPool:
        if self._pool is None:  # allocated at first use: building the engine costs no buffer memory
            self._pool = BufferPool(max(1, self.settings.buffer_count), self.largest, torch.float32,
                                    self.settings.pin_memory, key="offload_optimizer.buffer_count")
        return self._pool

    def path(self, i: int, name: str) -> str:
        return os.path.join(self.folder, f"{i}_{name}.tensor.swp")

    # ---- gradients ------------------------------------------------------------------------------------------
    def prepare_grad(self, i: int, numel: int) -> None:
        """Sub-group ``i``'s fp32 gradient lives in a file of ``numel`` elements, reserved now (a full disk fails
        here, not in the middle of a backward pass)."""
        path = self.path(i, GRAD)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if numel:
                    os.posix_fallocate(fd, 0, numel * 4)
            finally:
                os.close(fd)
            self.checksums.forget(path)
        except OSError as exc:
            raise AioError("reserve gradient swap file", path, exc.errno,
                           f"cannot reserve {numel * 4} bytes: {exc.strerror}") from None
        self.grads.add(i)

    def write_grad(self, i: int, offset: int, value: torch.Tensor) -> None:
        """Write ``value`` (fp32) at element ``offset`` of sub-group ``i``'s gradient file, and wait."""
        start, value = time.perf_counter(), value.contiguous()
        self.checksums.record(self.path(i, GRAD), value, offset * 4, whole_file=False)
        try:
            self.writer.sync_pwrite(value, self.path(i, GRAD), offset * 4, whole_file=False)
        except AioError as exc:
            raise annotate(exc, f"swap out gradient of optimizer sub-group {i}") from None
        self.stats.grad_write_bytes += value.numel() * 4
        self.stats.grad_write_s += time.perf_counter() - start

    def read_grad(self, i: int, offset: int, numel: int) -> torch.Tensor:
        """``numel`` fp32 elements from element ``offset`` of sub-group ``i``'s gradient file."""
        out = torch.empty(numel, dtype=torch.float32)
        start = time.perf_counter()
        try:
            self.reader.sync_pread(out, self.path(i, GRAD), offset * 4)
        except AioError as exc:
            raise annotate(exc, f"swap in gradient of optimizer sub-group {i}") from None
        self.checksums.verify(self.path(i, GRAD), out, offset * 4, f"swap in gradient of optimizer sub-group {i}")
        self.stats.grad_read_bytes += numel * 4
        self.stats.grad_read_s += time.perf_counter() - start
        return out

    # ---- whole sub-groups (initialisation, checkpoints) ---------------------------------------------------
    def write_now(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write sub-group ``i``'s tensors (``master`` first) and wait; they become what is on disk."""
        self._start_writes(i, tensors)
        self._wait(self.writer, f"swap out optimizer sub-group {i}", write=True)

    def read_new(self, i: int) -> dict[str, torch.Tensor]:
        """Sub-group ``i``'s tensors read into new memory (a checkpoint, a debug read)."""
        out = {name: torch.empty(self.numels[i], dtype=torch.float32) for name in self.names[i]}
        self._start_reads(i, out)
        self._wait(self.reader, f"swap in optimizer sub-group {i}", write=False)
        return out

    def init_masters(self, items: Iterable[tuple[int, Callable[[], torch.Tensor]]]) -> None:
        """Write each ``(sub-group, make_fp32_master)``'s master. ``fast_init``: through the pool's buffers with
        writes overlapping the next master's preparation; otherwise one new tensor at a time, synchronously."""
        if not self.settings.fast_init:
            for i, make in items:
                self.write_now(i, {MASTER: make()})
            return
        counted = self.stats.as_dict()  # these writes overlap the preparation: their waits are no bandwidth
        busy: list[torch.Tensor] = []
        for i, make in items:
            buffer = self.pool.get()
            if buffer is None:  # every buffer is being written: wait for them
                self._wait(self.writer, "swap out optimizer masters", write=True)
                for b in busy:
                    self.pool.put(b)
                busy, buffer = [], self.pool.get()
            master = make()
            view = buffer.narrow(0, 0, master.numel())
            view.copy_(master)
            del master
            self._start_writes(i, {MASTER: view})
            busy.append(buffer)
        self._wait(self.writer, "swap out optimizer masters", write=True)
        for b in busy:
            self.pool.put(b)
        self.stats.write_bytes, self.stats.write_s = counted["write_bytes"], counted["write_s"]

    # ---- the streamed step ----------------------------------------------------------------------------------
    def run(self, ids: list[int], step: StepFn) -> None:
        """Step each sub-group of ``ids`` in order: ``step(i, tensors)`` gets its master and states (views of
        pool buffers) and returns the tensors to keep (new states included); they are written back.

        If anything fails midway, every read and write in flight is waited for and all buffers return to the
        pool before the error propagates: a later run must not read a file whose write is still in flight, nor
        find its buffers gone."""
        try:
            self._run(ids, step)
        except BaseException:
            self._drain()
            raise

    def _drain(self) -> None:
        for handle in (self.reader, self.writer):
            try:
                handle.wait()
            except AioError:
                pass  # the error being raised already says what broke
        self._unverified = []  # reads of a failed run: their buffers are reclaimed, never used
        if self._pool is not None:
            self._pool.reclaim()

    def _run(self, ids: list[int], step: StepFn) -> None:
        s, prefetched = self.settings, None
        writing: _Writing | None = None  # buffers (and tensors) of the sub-group being written back
        for k, i in enumerate(ids):
            if prefetched is not None and prefetched[0] == i:
                buffers, views = prefetched[1], prefetched[2]
            else:
                buffers, writing = self._take(i, writing)
                views = self._read_into(i, buffers)
            self._wait(self.reader, f"swap in optimizer sub-group {i}", write=False)
            self.pool.check_ready(views.values())  # read and waited for: now the step may use them
            prefetched = None
            if s.pipeline_read and k + 1 < len(ids):
                more, writing = self._take(ids[k + 1], writing, required=False)
                if more is not None:
                    prefetched = (ids[k + 1], more, self._read_into(ids[k + 1], more))
            keep = step(i, views)
            if writing is not None:  # the previous write must end before another one starts
                writing = self._finish_write(writing)
            self._start_writes(i, keep)
            writing = (buffers, keep, i)
            if not s.pipeline_write:
                writing = self._finish_write(writing)
        if writing is not None:
            self._finish_write(writing)

    def _take(self, i: int, writing: _Writing | None,
              required: bool = True) -> tuple[list[torch.Tensor] | None, _Writing | None]:
        n = len(self.names[i]) + (i in self.grads)
        got = self.pool.get_many(n)
        if got is None and writing is not None:
            writing = self._finish_write(writing)
            got = self.pool.get_many(n)
        if got is None and required:
            raise ValueError(f"offload_optimizer.buffer_count={self.pool.count} is fewer than the {n} tensors of "
                             f"one sub-group (the fp32 master, gradient and optimizer states); set it to at least {n}"
                             f" ({3 * n} to pipeline reads and writes)")
        return got, writing

    def _finish_write(self, writing: _Writing) -> None:
        buffers, _, i = writing  # the tensors stay referenced until their write is done
        self._wait(self.writer, f"swap out optimizer sub-group {i}", write=True)
        for b in buffers:
            self.pool.put(b)
        return None

    def _read_into(self, i: int, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        names = self.names[i] + ([GRAD] if i in self.grads else [])
        views = {name: b.narrow(0, 0, self.numels[i]) for name, b in zip(names, buffers, strict=True)}
        self._start_reads(i, views)
        return views

    # ---- I/O ------------------------------------------------------------------------------------------------
    def _begin(self, t: torch.Tensor, handle: Any, what: str) -> None:
        """Tell the pool (if any) that ``t``'s buffer is in flight on ``handle`` until its wait."""
        if self._pool is not None:
            self._pool.begin(t, handle, what)

    def _abort(self, t: torch.Tensor) -> None:
        if self._pool is not None:
            self._pool.abort(t)

    def _start_reads(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            path = self.path(i, name)
            self._begin(t, self.reader, f"read of {os.path.basename(path)}")
            try:
                self.reader.async_pread(t, path)
            except AioError as exc:
                self._abort(t)
                raise annotate(exc, f"swap in optimizer sub-group {i} ({name})") from None
            self._unverified.append((path, t, f"swap in optimizer sub-group {i} ({name})"))
            self.stats.read_bytes += t.numel() * t.element_size()

    def _start_writes(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        if MASTER not in tensors:
            raise ValueError(f"optimizer swapper: sub-group {i}'s tensors {sorted(tensors)} have no '{MASTER}'")
        numel = tensors[MASTER].numel()
        tensors = {name: t for name, t in tensors.items() if name != GRAD}  # read for the step, never written back
        on_disk = set(self.names.get(i, ())) if self.numels.get(i) == numel else set()
        for name, t in tensors.items():
            if t.numel() != numel or t.dtype != torch.float32:
                raise ValueError(f"optimizer swapper: sub-group {i}'s {name!r} is {t.dtype} x {t.numel()}, the "
                                 f"master float32 x {numel}")
            path = self.path(i, name)
            self._begin(t, self.writer, f"write of {os.path.basename(path)}")
            src = t.contiguous()
            self.checksums.record(path, src)
            try:
                # a file of this size exists: overwrite it (see the module docstring); else create it whole
                self.writer.async_pwrite(src, path, whole_file=name not in on_disk)
            except AioError as exc:
                self._abort(t)
                raise annotate(exc, f"swap out optimizer sub-group {i} ({name})") from None
            self.stats.write_bytes += t.numel() * t.element_size()
        self.names[i] = [MASTER] + sorted(n for n in tensors if n != MASTER)
        self.numels[i] = numel

    def _wait(self, handle: Any, what: str, write: bool) -> None:
        start = time.perf_counter()
        try:
            handle.wait()
        except AioError as exc:
            raise annotate(exc, what) from None
        finally:  # returned or raised, the wait covered every request of the handle
            if self._pool is not None:
                self._pool.settle(handle)
            spent = time.perf_counter() - start
            if write:
                self.stats.write_s += spent
            else:
                self.stats.read_s += spent
            pending = [] if handle is not self.reader else self._unverified
            self._unverified = self._unverified if handle is not self.reader else []
        for path, t, done in pending:  # read and waited for: the bytes must be those that were written
            self.checksums.verify(path, t, what=done)

    def close(self) -> None:
        """Finish pending I/O, free the buffers and delete the swap files."""
        close_handles(self.reader, self.writer)
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._cleanup()
