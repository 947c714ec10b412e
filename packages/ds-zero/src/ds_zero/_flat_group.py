"""One optimizer parameter group under ZeRO stage 1/2: its flat low-precision buffer, fp32 master partition
and gradient partition.

The model's parameters become views into one flat buffer per group (``lp_flat``, the model dtype, laid out by
a :class:`~ds_zero.partition.FlatLayout`), so gathering the updated partitions rewrites every parameter in
place with no per-parameter copies. This rank keeps only its partition of the fp32 master weights
(``master``, the tensor the wrapped torch optimizer steps, on the CPU with offload) and of the gradients
(``grad_partition``: the model dtype, or fp32 with fp32 gradient accumulation). Stage 2 keeps the gradient
partition for the whole run; stage 1 (``persistent_grads=False``) allocates it when gradients are reduced and
frees it after the step, as DeepSpeed does, since stage 1 holds full gradients in between anyway.

A group is partitioned over the data-parallel group unless its owner gives it another one (:class:`GroupComm`:
MoE expert groups are partitioned and reduced over their expert-data-parallel group); ``process_group`` and
``grad_divisor`` say over which ranks its gradients are summed and by what they are divided.

Flattening needs room for the flat buffer next to the parameters it copies. When the parameters' device has
less free memory than the buffer takes, the parameters move to the CPU first (freeing their device memory), the
buffer is built there and moved to the device, as DeepSpeed does; ``flattened_on_device`` says which way it went.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ds_zero.host_pinning import TORCH_PINNING, PinnedBuffers
from ds_zero.partition import FlatLayout, Fragment, round_robin_order


@dataclass(frozen=True, eq=False)
class GroupComm:
    """The ranks one optimizer parameter group is partitioned, reduced and gathered over, instead of the
    data-parallel group: ``group`` (a process group, None for the default one) of ``world_size`` ranks.
    Gradients summed over it are divided by ``grad_divisor`` (None: the data-parallel world size). MoE expert
    groups: the expert-data-parallel group, divided by the whole data-parallel size, as DeepSpeed does, so that
    expert gradients are averages over every rank's tokens and do not depend on ``ep_size``."""

    group: Any = None
    world_size: int = 1
    grad_divisor: float | None = None


def _cpu_available_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (``MemAvailable``: free pages plus the page
    cache it can reclaim), else the free pages alone."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device`` (for the CPU: the physical memory not in use), or None when the
    device cannot say."""
    if device.type == "cpu":
        return _cpu_available_bytes()
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    accel = getattr(torch, "accelerator", None)
    info = getattr(accel, "get_memory_info", None)
    try:
        return info(device)[0] if info is not None else None
    except (RuntimeError, TypeError):
        return None


def param_homes(groups: list[FlatGroup]) -> dict[torch.nn.Parameter, tuple[int, int]]:
    """Parameter -> (group index, index in that group's flat order)."""
    return {p: (g, i) for g, fg in enumerate(groups) for i, p in enumerate(fg.params)}


class FlatGroup:
    """Buffers of one parameter group; ``params`` and ``names`` are in flat (layout) order."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], world_size: int, rank: int,
                 grad_dtype: torch.dtype, master_device: torch.device, round_robin: bool = False,
                 pin_memory: bool = False, persistent_grads: bool = True,
                 pinned: PinnedBuffers | None = None) -> None:
        if round_robin:
            order = round_robin_order([p.numel() for p in params], world_size)
            params, names = [params[i] for i in order], [names[i] for i in order]
        self.params = params
        self.names = names
        self.rank = rank
        self.process_group: Any = None  # the ranks of this group's partitions (None: the default group)
        self.grad_divisor = float(world_size)  # summed gradients are divided by this (set by the owner)
        self.layout = FlatLayout([p.numel() for p in params], world_size)
        self.own: list[Fragment] = self.layout.fragments(rank)
        device = params[0].device if params else torch.device("cpu")
        dtype = params[0].dtype if params else torch.float32
        self.lp_flat = self._flatten_params(device, dtype)
        start, end = self.layout.partition_range(rank)
        self.lp_partition = self.lp_flat[start:end]
        master = self.lp_partition.detach().to(master_device, torch.float32, copy=True)
        if pin_memory:  # ``pinned``: the owner's record of its pinned buffers, which it frees at destroy()
            master = (pinned if pinned is not None else PinnedBuffers(TORCH_PINNING)).pin(master)
        self.master = torch.nn.Parameter(master)
        self.grad_dtype, self.grad_device = grad_dtype, device
        self.persistent_grads = persistent_grads
        self._grad_partition: torch.Tensor | None = None
        if persistent_grads:
            self._grad_partition = torch.zeros(self.layout.partition_numel, dtype=grad_dtype, device=device)

    @property
    def grad_partition(self) -> torch.Tensor:
        """This rank's gradient partition (allocated, zeroed, on first use when not persistent)."""
        if self._grad_partition is None:
            self._grad_partition = torch.zeros(self.layout.partition_numel, dtype=self.grad_dtype,
                                               device=self.grad_device)
        return self._grad_partition

    @property
    def grad_partition_allocated(self) -> bool:
        return self._grad_partition is not None

    def clear_grads(self) -> None:
        """Zero the gradient partition (persistent), or free it."""
        if self.persistent_grads:
            self.grad_partition.zero_()
        else:
            self._grad_partition = None

    def _flatten_params(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        for p in self.params:
            if p.dtype != dtype or p.device != device:
                raise ValueError(f"ZeRO: parameter of shape {tuple(p.shape)} is {p.dtype} on {p.device}; every "
                                 f"parameter of an optimizer group must share {dtype} on {device}")
        need = self.layout.padded_numel * torch.empty((), dtype=dtype).element_size()
        free = free_memory_bytes(device)
        self.flattened_on_device = free is None or free >= need
        staging = device if self.flattened_on_device else torch.device("cpu")
        with torch.no_grad():
            if staging != device:  # free the parameters' device memory before the buffer takes its place
                for p in self.params:
                    p.data = p.data.to(staging)
            flat = torch.zeros(self.layout.padded_numel, dtype=dtype, device=staging)
            for p, offset in zip(self.params, self.layout.offsets, strict=True):
                flat[offset:offset + p.numel()].copy_(p.data.reshape(-1))
            flat = flat.to(device)
            for p, offset in zip(self.params, self.layout.offsets, strict=True):
                p.data = flat[offset:offset + p.numel()].view_as(p)
        return flat

    # ---- copies between the partitions --------------------------------------------------------------
    def copy_master_to_lp(self) -> None:
        """Write the updated fp32 master partition into this rank's slice of the model weights."""
        with torch.no_grad():
            # host-to-device may run asynchronously: the master is not written again before the next step, and the
            # gather that follows is ordered after the copy on the device's stream
            self.lp_partition.copy_(self.master.detach(), non_blocking=self.master.is_pinned())

    def sync_master_from_lp(self) -> None:
        """Refresh the master partition from the model weights (after loading weights only)."""
        with torch.no_grad():
            self.master.data.copy_(self.lp_partition)

    def collect_local_grads(self, grads: list[torch.Tensor | None]) -> None:
        """Fill the gradient partition from full local gradients (``grads`` aligned with ``params``): the
        single-rank path, and stage 1 steps whose gradients were never reduced (``no_sync`` at the boundary)."""
        self.grad_partition.zero_()
        for frag in self.own:
            grad = grads[frag.index]
            if grad is not None:
                dense = grad.to_dense() if grad.is_sparse else grad  # e.g. Embedding(sparse=True)
                src = dense.reshape(-1).narrow(0, frag.tensor_offset, frag.numel)
                self.grad_partition.narrow(0, frag.partition_offset, frag.numel).copy_(src)

    def fp32_grad(self) -> torch.Tensor:
        """The gradient partition as fp32 on the master's device (the buffer itself when it already is)."""
        gp = self.grad_partition
        if gp.dtype == torch.float32 and gp.device == self.master.device:
            return gp
        # blocking: the CPU optimizer reads it right away (a non-blocking device-to-host copy may still be running)
        return gp.to(self.master.device, torch.float32)
