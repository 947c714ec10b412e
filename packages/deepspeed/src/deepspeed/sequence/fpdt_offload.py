"""``SequenceChunk``: one FPDT activation chunk with a host copy and, while in use, a working copy on its device.

FPDT keeps every finished chunk (queries, keys, values, outputs, log-sum-exps, layer inputs) in host memory and
brings back only the few chunks the current step reads, which bounds device memory by the chunk size instead of
the sequence length. For a chunk on an accelerator the host copy lives in page-locked memory; for a chunk already
in host memory the host copy is the tensor itself and ``load_to_gpu`` makes a fresh working copy, so the code path
(and its bookkeeping) is the same on CPU.

Ownership: every copy here runs on the current stream. A device-to-host copy into the pinned buffer is ordered
before any later host-to-device copy out of it on that stream, so no wait is needed between ``overwrite_to_cpu``
and a later ``load_to_gpu``; nothing reads the host buffer from Python while a copy is in flight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from deepspeed.accelerator import get_accelerator


class SequenceChunk:
    """A chunk's host copy (``cpu_chunk``) and its device working copy (``gpu_chunk``, None while offloaded).

    ``device``: where ``load_to_gpu`` puts the working copy (default: the chunk's own device); ``is_in_use``: keep
    ``chunk`` itself as the working copy (it is being computed with) instead of starting offloaded.
    """

    def __init__(self, chunk: Tensor, device: Any = None, is_in_use: bool = False) -> None:
        self.chunk_shape = chunk.shape
        self.chunk_dtype = chunk.dtype
        self.device = chunk.device if device is None else torch.device(device)
        if chunk.device.type == "cpu":
            self.cpu_chunk = chunk
        else:
            accel = get_accelerator()
            if accel.on_accelerator(chunk):
                host = accel.pin_empty(tuple(chunk.shape), dtype=chunk.dtype)
            else:
                host = torch.empty(chunk.shape, dtype=chunk.dtype, device="cpu")
            host.copy_(chunk, non_blocking=host.is_pinned())
            self.cpu_chunk = host
        self.gpu_chunk: Tensor | None = chunk if is_in_use else None

    @property
    def is_resident(self) -> bool:
        """Whether a working copy is on the device now."""
        return self.gpu_chunk is not None

    def load_to_gpu(self) -> Tensor:
        """Copy the host copy to a fresh working copy on ``device`` (the chunk must be offloaded)."""
        if self.gpu_chunk is not None:
            raise RuntimeError(f"SequenceChunk.load_to_gpu: the {tuple(self.chunk_shape)} chunk is already loaded; "
                               f"offload() it first")
        working = torch.empty(self.chunk_shape, dtype=self.chunk_dtype, device=self.device)
        working.copy_(self.cpu_chunk, non_blocking=self.cpu_chunk.is_pinned())
        self.gpu_chunk = working
        return working

    def get_gpu_chunk(self) -> Tensor:
        """The working copy (the chunk must be loaded)."""
        self.check_gpu_chunk()
        return self.gpu_chunk

    def check_gpu_chunk(self) -> bool:
        """True when a working copy is on ``device``; raises otherwise."""
        if self.gpu_chunk is None:
            raise RuntimeError(f"SequenceChunk: the {tuple(self.chunk_shape)} chunk is offloaded; load_to_gpu() it "
                               f"before use")
        if self.gpu_chunk.device != self.device:
            raise RuntimeError(f"SequenceChunk: the working copy is on {self.gpu_chunk.device}, expected "
                               f"{self.device}")
        return True

    def offload(self) -> None:
        """Drop the working copy; the host copy stays (call ``overwrite_to_cpu`` first to keep changes)."""
        self.check_gpu_chunk()
        self.gpu_chunk = None

    def overwrite_to_cpu(self) -> None:
        """Write the working copy's values back to the host copy."""
        self.check_gpu_chunk()
        if self.gpu_chunk is not self.cpu_chunk:
            self.cpu_chunk.copy_(self.gpu_chunk, non_blocking=self.cpu_chunk.is_pinned())

    def use(self) -> Tensor:
        """The working copy, loading it first when offloaded."""
        return self.gpu_chunk if self.gpu_chunk is not None else self.load_to_gpu()
