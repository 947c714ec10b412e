"""A ZeRO-3 optimizer sub-group: its parameters' partitions as one flat low-precision buffer, the fp32 master
and the gradient partition in the same layout, and where each parameter sits in every rank's partition.

:class:`Z3Group` is what :class:`ds_zero.zero3.optimizer.DeepSpeedZeroOptimizer_Stage3` steps, one per
sub-group (``sub_group_size`` partition elements, see :func:`sub_groups`).
"""

from __future__ import annotations

import torch

from ds_zero.host_pinning import TORCH_PINNING, PinnedBuffers
from ds_zero.partition import Fragment
from ds_zero.swap.param_swapper import is_swapped
from ds_zero.zero3.param import partition_copy

__all__ = ["Z3Group", "Z3Layout", "sub_groups"]


class Z3Layout:
    """Where a group's parameters sit in every rank's flat partition (the stage 1/2 ``FlatLayout`` questions,
    answered for per-parameter partitioning)."""

    def __init__(self, params: list[torch.nn.Parameter], offsets: list[int], world: int) -> None:
        self.params, self.offsets, self.world = params, offsets, world

    def owners(self, index: int) -> list[tuple[int, Fragment]]:
        p = self.params[index]
        part = p.ds_tensor.numel()
        out = []
        for rank in range(self.world):
            start = rank * part
            numel = min(part, p.ds_numel - start)
            if numel > 0:
                out.append((rank, Fragment(index, start, self.offsets[index], start, numel)))
        return out


class Z3Group:
    """One optimizer parameter group's partitions; ``params`` and ``names`` in flat order."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], grad_dtype: torch.dtype,
                 master_device: torch.device, pin_memory: bool, master_on_nvme: bool = False,
                 pinned: PinnedBuffers | None = None) -> None:
        self.params, self.names = params, names
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.ds_tensor.numel()
        self.numel = total
        first = params[0].ds_tensor if params else torch.empty(0)
        # ZeRO-Infinity parameters: the partitions live in their swap files, not in one flat buffer
        self.lp_swapped = any(is_swapped(p) for p in params)
        device = torch.device("cpu") if self.lp_swapped else first.device
        self.lp_flat = None if self.lp_swapped else self._flatten(first.dtype, device)
        self.master_on_nvme = master_on_nvme
        if master_on_nvme:  # the optimizer swapper holds it; present only while its sub-group steps
            master = torch.empty(0, dtype=torch.float32)
        elif self.lp_flat is not None and first.dtype == torch.float32 and device == master_device \
                and not pin_memory:
            # fp32 training without optimizer offload: the fp32 partitions are the masters (a copy would make the
            # model states 20 instead of 16 bytes per parameter, over N ranks)
            master = self.lp_flat.detach()
        else:
            master = self.initial_master().to(master_device)
            if pin_memory:  # ``pinned``: the owner's record of its pinned buffers, which it frees at destroy()
                master = (pinned if pinned is not None else PinnedBuffers(TORCH_PINNING)).pin(master)
        self.master = torch.nn.Parameter(master)
        self.grad_dtype, self.grad_device = grad_dtype, device
        # ZeRO-Infinity: a swapped sub-group's gradient goes to NVMe as it arrives; per parameter, whether it has
        # one in this accumulation window and its squared norm (the step's clipping needs the global norm)
        self.grad = torch.zeros(0 if master_on_nvme else total, dtype=grad_dtype, device=device)
        self.grad_written: dict[int, float] = {}
        self.index = {id(p): i for i, p in enumerate(params)}
        space = params[0].ds_space if params else None
        self.rank = space.rank if space is not None else 0
        self.layout = Z3Layout(params, self.offsets, space.world if space is not None else 1)

    def _flatten(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One flat buffer for the group's partitions, which become views of it."""
        flat = torch.empty(self.numel, dtype=dtype, device=device)
        with torch.no_grad():
            for p, offset in zip(self.params, self.offsets, strict=True):
                view = flat.narrow(0, offset, p.ds_tensor.numel())
                view.copy_(p.ds_tensor)
                view.ds_numel = view.numel()
                p.ds_tensor = view
        return flat

    def initial_master(self) -> torch.Tensor:
        """A new fp32 copy of the group's partitions (read from NVMe for swapped ones), in flat order."""
        if self.lp_flat is not None:
            return self.lp_flat.detach().to(torch.float32, copy=True)
        out = torch.empty(self.numel, dtype=torch.float32)
        for p, offset in zip(self.params, self.offsets, strict=True):
            out.narrow(0, offset, p.ds_tensor.numel()).copy_(partition_copy(p))
        return out

    @property
    def grad_partition(self) -> torch.Tensor:
        return self.grad

    grad_partition_allocated = True

    def repoint(self) -> None:
        """``lp_flat`` moved (``offload_states``): the partitions become views of its new storage again."""
        if self.lp_flat is None:
            return
        flat = self.lp_flat.detach()
        for p, offset in zip(self.params, self.offsets, strict=True):
            view = flat.narrow(0, offset, p.ds_tensor.numel())
            view.ds_numel = view.numel()
            p.ds_tensor = view

    def grad_slice(self, param: torch.nn.Parameter) -> torch.Tensor:
        i = self.index[id(param)]
        return self.grad.narrow(0, self.offsets[i], param.ds_tensor.numel())

    def master_slice(self, param: torch.nn.Parameter) -> torch.Tensor:
        i = self.index[id(param)]
        return self.master.detach().narrow(0, self.offsets[i], param.ds_tensor.numel())

    def _shares_master(self) -> bool:  # checked at each use: offload_states may move one of the two apart
        return self.lp_flat is not None and self.master.detach().data_ptr() == self.lp_flat.detach().data_ptr()

    def copy_master_to_lp(self) -> None:
        if self._shares_master():
            return
        master = self.master.detach()
        with torch.no_grad():
            if self.lp_flat is not None:
                self.lp_flat.copy_(master, non_blocking=master.is_pinned())
                return
            swappers = set()
            for p, offset in zip(self.params, self.offsets, strict=True):
                value = master.narrow(0, offset, p.ds_tensor.numel())
                if is_swapped(p):  # written through to its swap file; all written, then waited for
                    p.ds_swapper.write(p, value, wait=False)
                    swappers.add(p.ds_swapper)
                else:
                    p.ds_tensor.copy_(value)
            for swapper in swappers:
                swapper.flush()

    def sync_master_from_lp(self) -> None:
        if self._shares_master():
            return
        with torch.no_grad():
            self.master.data.copy_(self.lp_flat if self.lp_flat is not None else self.initial_master())

    def fp32_grad(self) -> torch.Tensor:
        if self.grad.dtype == torch.float32 and self.grad.device == self.master.device:
            return self.grad
        return self.grad.to(self.master.device, torch.float32)


def sub_groups(params: list[torch.nn.Parameter], size: int) -> list[list[torch.nn.Parameter]]:
    """``params`` cut into runs of at least ``size`` partition elements (the last run may be shorter; never
    no run at all)."""
    out, current, total = [], [], 0
    for p in params:
        current.append(p)
        total += p.ds_tensor.numel()
        if total >= size:
            out.append(current)
            current, total = [], 0
    if current or not out:
        out.append(current)
    return out
