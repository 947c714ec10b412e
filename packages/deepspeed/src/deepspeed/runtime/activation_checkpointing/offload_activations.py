"""Offloading checkpointed layers' inputs to (pinned) host memory: ``CheckpointHiddenStatesOffload``.

With non-reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, as
Hugging Face models use it) each checkpointed layer keeps only its input, the hidden states, until backward
recomputes the layer. ``CheckpointHiddenStatesOffload`` is a ``torch.autograd.graph.saved_tensors_hooks`` context:
the inputs *marked* for it (``mark(tensor)``, or automatically for Hugging Face ``GradientCheckpointingLayer``
layers, see ``_offload_marker``) are copied to host buffers when autograd saves them and copied back to the device
when backward unpacks them; every other saved tensor passes through untouched. Restored tensors have the
original's shape, stride and values, so gradients are bitwise those without offloading.

What is never offloaded (counted in ``stats.skipped_marked_tensors``): tensors that are not on the accelerator,
anything on a synchronized device (the CPU: host memory is where it already is), tensors smaller than
``min_offload_bytes``, parameters and buffers, and overlapping views (a zero stride: a dense copy could not be
written back into aliased storage).

The newest ``keep_last_count`` marked inputs stay on the device (backward needs them first, before a device to
host copy could pay off); when a newer one arrives the oldest kept one starts its copy.

Buffer ownership with ``use_streams`` (a side copy stream on devices that have streams):
- device to host: the copy runs on the side stream after it waited for the compute stream. The device tensor is
  ``record_stream``-ed on the side stream, so its memory is not reused before the copy ends, and (up to
  ``max_fwd_stash_count`` newest ones) also held in a stash with the copy's event: a backward that reaches such
  a tensor before the stash lets it go uses it directly (after waiting on the event) instead of copying back.
- host to device: a fresh device tensor is filled on the side stream; the compute stream waits on the copy's
  event before any use, the tensor is ``record_stream``-ed on the compute stream, and the host buffer goes back to
  the pool only once that event has completed (``_pending_cpu_buffers``).
Without streams every copy is synchronous on the current stream. Host buffers are dense, keyed by (shape, dtype,
layout, pinned) and pooled (at most ``max_cpu_buffer_pool_count``) for reuse across steps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
from torch.autograd.graph import saved_tensors_hooks

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import _offload_marker

__all__ = [
    "CheckpointActivationOffloadStats", "CheckpointHiddenStatesOffload",
    "get_checkpoint_hidden_states_offloading_ctx_manager", "patch_gradient_checkpointing_layer_marker",
]

_BufferKey = tuple[tuple[int, ...], torch.dtype, torch.layout, bool]


@dataclass
class CheckpointActivationOffloadStats:
    """Counts since the context was last entered (or ``reset``); bytes are host-buffer bytes."""

    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    kept_last_tensors: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0


@dataclass(frozen=True)
class _OffloadedTensorRef:
    """What autograd holds instead of an offloaded tensor: its id in the engine."""

    tensor_id: int


class _HostCopy(NamedTuple):
    host: torch.Tensor  # dense host buffer with the values
    device: torch.device
    shape: torch.Size
    stride: tuple[int, ...]
    key: _BufferKey


def _record_stream(tensor: torch.Tensor, stream: Any) -> None:
    tensor.record_stream(stream)


def _check_count(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


class _ActivationOffloadEngine:
    """The copies, the host-buffer pool and the keep-last window; driven by ``offload_input``/``restore_input``."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1) -> None:
        self.keep_last_count = _check_count("keep_last_count", keep_last_count)
        self.max_fwd_stash_count = _check_count("max_fwd_stash_count", max_fwd_stash_count)
        self.max_cpu_buffer_pool_count = _check_count("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count)
        self.min_offload_bytes = _check_count("min_offload_bytes", min_offload_bytes)
        self.use_pin_memory = bool(use_pin_memory)
        self.stats = CheckpointActivationOffloadStats()
        accelerator = get_accelerator()
        stream_cls = None if accelerator.is_synchronized_device() else accelerator.Stream
        self.s1 = stream_cls() if use_streams and stream_cls is not None else None
        self.use_streams = self.s1 is not None
        self._next_id = 0
        self._keep_last: dict[int, torch.Tensor] = {}  # id -> device tensor, oldest first
        self._tracker: dict[int, _HostCopy] = {}  # id -> host copy
        self._fwd_stash: dict[int, tuple[torch.Tensor, Any]] = {}  # id -> (device tensor, copy event)
        self._restored: dict[int, torch.Tensor] = {}  # id -> device tensor already unpacked (retain_graph)
        self._cpu_buffer_pool: dict[_BufferKey, list[torch.Tensor]] = {}
        self._cpu_buffer_pool_count = 0
        self._pending_cpu_buffers: list[tuple[_BufferKey, torch.Tensor, Any]] = []

    # -- streams --------------------------------------------------------------------------------------------
    @property
    def compute_stream(self) -> Any:
        return get_accelerator().current_stream()

    def _on(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if stream is None else get_accelerator().stream(stream)

    # -- what to offload ------------------------------------------------------------------------------------
    def _should_skip(self, tensor: torch.Tensor) -> bool:
        accelerator = get_accelerator()
        buffer_cls = getattr(torch.nn, "Buffer", None)
        return (accelerator.is_synchronized_device() or not accelerator.on_accelerator(tensor)
                or tensor.nbytes < self.min_offload_bytes or isinstance(tensor, torch.nn.Parameter)
                or (buffer_cls is not None and isinstance(tensor, buffer_cls))
                or (tensor.numel() > 1 and 0 in tensor.stride()))

    # -- host buffers ---------------------------------------------------------------------------------------
    def _buffer_key(self, tensor: torch.Tensor) -> _BufferKey:
        # host buffers are dense: tensors differing only in strides share them
        return tuple(tensor.size()), tensor.dtype, tensor.layout, self.use_pin_memory

    def _pool_cpu_buffer(self, key: _BufferKey, buffer: torch.Tensor) -> None:
        if self._cpu_buffer_pool_count < self.max_cpu_buffer_pool_count:
            self._cpu_buffer_pool.setdefault(key, []).append(buffer)
            self._cpu_buffer_pool_count += 1

    def _reap_cpu_buffer_pool(self, force: bool = False) -> None:
        """Pool the host buffers whose host-to-device copy has completed (``force``: wait for all of them)."""
        pending, self._pending_cpu_buffers = self._pending_cpu_buffers, []
        for key, buffer, event in pending:
            if force:
                event.synchronize()
            elif not event.query():
                self._pending_cpu_buffers.append((key, buffer, event))
                continue
            self._pool_cpu_buffer(key, buffer)

    def _empty_cpu_like(self, tensor: torch.Tensor) -> tuple[torch.Tensor, _BufferKey]:
        self._reap_cpu_buffer_pool()
        key = self._buffer_key(tensor)
        pooled = self._cpu_buffer_pool.get(key)
        if pooled:
            self._cpu_buffer_pool_count -= 1
            return pooled.pop(), key
        host = torch.empty(tuple(tensor.size()), dtype=tensor.dtype, layout=tensor.layout, device="cpu")
        if self.use_pin_memory:  # through the accelerator: its pinning backend and accounting
            host = get_accelerator().pin_memory(host, make_copy=False)
        return host, key

    # -- forward: offload -----------------------------------------------------------------------------------
    def offload_input(self, tensor: torch.Tensor) -> Optional[int]:
        """Take ``tensor`` for offloading; its id (for ``restore_input``), or None when it is not offloaded."""
        if self._should_skip(tensor):
            self.stats.skipped_marked_tensors += 1
            return None
        self._next_id += 1
        tensor_id = self._next_id
        self._keep_last[tensor_id] = tensor
        while len(self._keep_last) > self.keep_last_count:
            oldest = next(iter(self._keep_last))
            self._start_offload(oldest, self._keep_last.pop(oldest), newest_id=tensor_id)
        return tensor_id

    def _start_offload(self, tensor_id: int, tensor: torch.Tensor, newest_id: int) -> None:
        if self.use_streams:
            # the stash holds at most the max_fwd_stash_count newest offloads (ids counted from the newest input)
            for stashed in [i for i in self._fwd_stash if i <= newest_id - self.max_fwd_stash_count]:
                del self._fwd_stash[stashed]
            self.s1.wait_stream(self.compute_stream)
        with self._on(self.s1):
            host, key = self._empty_cpu_like(tensor)
            host.copy_(tensor.detach(), non_blocking=self.use_streams)
        self._tracker[tensor_id] = _HostCopy(host, tensor.device, tensor.size(), tensor.stride(), key)
        if self.use_streams:
            _record_stream(tensor, self.s1)
            if self.max_fwd_stash_count:
                self._fwd_stash[tensor_id] = (tensor, self.s1.record_event())
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += host.nbytes

    # -- backward: restore ----------------------------------------------------------------------------------
    def restore_input(self, tensor_id: int) -> torch.Tensor:
        """The tensor behind ``tensor_id`` back on its device, for one use (the id is consumed)."""
        return self._restore_tensor(tensor_id, cache=False)

    def _restore_tensor(self, tensor_id: int, cache: bool = True) -> torch.Tensor:
        # cache: a second unpack of the same id (backward with retain_graph) gets the same tensor, no new copy
        if cache and tensor_id in self._restored:
            return self._restored[tensor_id]
        if tensor_id in self._keep_last:
            restored = self._keep_last.pop(tensor_id)
            self.stats.kept_last_tensors += 1
        elif tensor_id in self._fwd_stash:
            restored, event = self._fwd_stash.pop(tensor_id)
            self.compute_stream.wait_event(event)  # its host copy must be finished before the buffer is pooled
            copy = self._tracker.pop(tensor_id)
            self._pool_cpu_buffer(copy.key, copy.host)
            self._count_restore(restored)
        else:
            restored = self._copy_back(tensor_id)
            self._count_restore(restored)
        if cache:
            self._restored[tensor_id] = restored
        return restored

    def _copy_back(self, tensor_id: int) -> torch.Tensor:
        copy = self._tracker.pop(tensor_id, None)
        if copy is None:
            raise RuntimeError(f"offloaded activation {tensor_id} is no longer tracked: backward() must run inside "
                               "the CheckpointHiddenStatesOffload context that saved it, before reset()")
        with self._on(self.s1):
            # fresh storage with the original strides (a source storage offset is not reproduced)
            restored = torch.empty_strided(copy.shape, copy.stride, dtype=copy.host.dtype, device=copy.device)
            restored.copy_(copy.host, non_blocking=self.use_streams)
        if self.use_streams:
            event = self.s1.record_event()
            compute = self.compute_stream
            compute.wait_event(event)
            _record_stream(restored, compute)
            self._pending_cpu_buffers.append((copy.key, copy.host, event))
        else:
            self._pool_cpu_buffer(copy.key, copy.host)
        return restored

    def _count_restore(self, tensor: torch.Tensor) -> None:
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += tensor.nbytes

    # -- lifetime -------------------------------------------------------------------------------------------
    def _sync_copy_streams(self) -> None:
        if self.use_streams:
            self.s1.synchronize()
            self._reap_cpu_buffer_pool(force=True)

    def _clear(self) -> None:
        self._tracker.clear()
        self._fwd_stash.clear()
        self._keep_last.clear()
        self._restored.clear()
        self._pending_cpu_buffers.clear()

    def reset(self) -> None:
        """Forget every tracked tensor and zero the stats (after the copies in flight finished)."""
        self._sync_copy_streams()
        self._clear()
        self.stats = CheckpointActivationOffloadStats()
        self._next_id = 0

    def _sync_and_clear(self) -> None:
        # leaving the context: copies finished, unrestored host buffers back to the pool for the next step
        self._sync_copy_streams()
        for copy in self._tracker.values():
            self._pool_cpu_buffer(copy.key, copy.host)
        self._clear()


class CheckpointHiddenStatesOffload(_ActivationOffloadEngine, saved_tensors_hooks):
    """A ``saved_tensors_hooks`` context that offloads the marked checkpoint inputs to host memory.

    Mark a layer's input with ``mark(tensor)`` before the checkpointed call (Hugging Face
    ``GradientCheckpointingLayer`` layers are marked automatically while the context is active). Backward must
    run inside the context. One instance is not re-entrant; instances may nest (the innermost receives marks).
    """

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1) -> None:
        _ActivationOffloadEngine.__init__(self, use_pin_memory, use_streams, min_offload_bytes, max_fwd_stash_count,
                                          max_cpu_buffer_pool_count, keep_last_count)
        self._allowed: dict[int, int] = {}  # id(tensor) -> pending marks
        self._marker_held = False
        saved_tensors_hooks.__init__(self, self._pack_tensor, self._unpack_tensor)

    def mark(self, tensor: torch.Tensor) -> None:
        """Offload ``tensor`` the next time autograd saves it (once per mark)."""
        self._allowed[id(tensor)] = self._allowed.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _consume_mark(self, tensor: torch.Tensor) -> bool:
        count = self._allowed.get(id(tensor), 0)
        if count == 0:
            return False
        if count == 1:
            del self._allowed[id(tensor)]
        else:
            self._allowed[id(tensor)] = count - 1
        return True

    def _pack_tensor(self, tensor: torch.Tensor) -> Any:
        self.stats.saved_tensors_seen += 1
        if not self._consume_mark(tensor):
            return tensor
        tensor_id = self.offload_input(tensor)
        return tensor if tensor_id is None else _OffloadedTensorRef(tensor_id)

    def _unpack_tensor(self, packed: Any) -> Any:
        if isinstance(packed, _OffloadedTensorRef):
            return self._restore_tensor(packed.tensor_id, cache=True)
        return packed

    def reset(self) -> None:
        super().reset()
        self._allowed.clear()

    def _sync_and_clear(self) -> None:
        super()._sync_and_clear()
        self._allowed.clear()

    def __enter__(self) -> CheckpointHiddenStatesOffload:
        _offload_marker.push_manager(self)  # raises for an instance already active
        try:
            self._marker_held = _offload_marker.install_marker()
            self.reset()
            saved_tensors_hooks.__enter__(self)
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._sync_and_clear()
        finally:
            try:
                self._leave()
            finally:
                saved_tensors_hooks.__exit__(self, *exc)

    def _leave(self) -> None:
        _offload_marker.pop_manager(self)
        if self._marker_held:
            self._marker_held = False
            _offload_marker.release_marker()


def patch_gradient_checkpointing_layer_marker() -> None:
    """Install the ``GradientCheckpointingLayer`` marker now (entering a context does it anyway); needs
    transformers >= 4.52. Installed this way it stays installed (contexts only mark through it)."""
    if not _offload_marker.install_marker(permanent=True):
        raise RuntimeError("patch_gradient_checkpointing_layer_marker needs transformers >= 4.52 (the version "
                           "with GradientCheckpointingLayer); install or upgrade it: pip install -U transformers")


def get_checkpoint_hidden_states_offloading_ctx_manager(
        use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1) -> CheckpointHiddenStatesOffload:
    """A new ``CheckpointHiddenStatesOffload`` with these settings (DeepSpeed's factory name)."""
    return CheckpointHiddenStatesOffload(use_pin_memory=use_pin_memory, use_streams=use_streams,
                                         min_offload_bytes=min_offload_bytes, max_fwd_stash_count=max_fwd_stash_count,
                                         max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
                                         keep_last_count=keep_last_count)
