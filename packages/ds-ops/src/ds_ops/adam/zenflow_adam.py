"""ZenFlow's selective AdamW: an AdamW step on the selected slice of each parameter, the rest untouched.

ZenFlow (``zero_optimization.zenflow``) ranks gradient columns by importance, updates the top ones on the
accelerator every step and leaves the others to an infrequent offloaded full step. The engine hands each
parameter one selective step as attributes:

- ``selected_indices``: 1-D index tensor of the chosen columns. ZeRO 1/2 (``ZenFlowSelectiveAdamW``) index
  dim 1 of the weight; ZeRO-3 (``ZenFlowSelectiveAdamW_stage3``) stores a partition transposed, so they
  index the rows of ``ds_tensor`` viewed as ``(-1, ds_shape[1])``. 1-D parameters are taken whole.
- ``selected_grad``: the gradient of that slice, shaped like it.
- ``temp_selected_param`` (optional): a snapshot of the slice from ``temp_copy_param``. The update starts
  from it, because the offloaded full step copies its master weights over the parameter and would
  otherwise discard what the selective steps did to those columns meanwhile.

Moments cover the slice only. With ``offload=False`` they live in ``self.state[p]``; with ``offload=True``
in ``p.exp_avg_cpu_data`` / ``p.exp_avg_sq_cpu_data`` on the host, brought to the gradient's device one
bucket (``bucket_size`` slice elements) at a time and written back. Both paths call the same AdamW
(``torch.optim.adamw.adamw``) on the same values, so they agree bitwise. After a step ``selected_grad``
and ``temp_selected_param`` are None.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterable, Mapping

import torch
from torch.optim.adamw import adamw as _adamw

logger = logging.getLogger(__name__)

__all__ = ["ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3"]


def _has_selection(param: torch.Tensor) -> bool:
    return getattr(param, "selected_grad", None) is not None


class _SelectiveAdamW(torch.optim.AdamW, metaclass=abc.ABCMeta):
    """The update, the moments and the buckets; subclasses say where a parameter's selected slice lives."""

    def __init__(self, *args, offload: bool = False, bucket_size: float = 5e8, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(bucket_size, int | float) or isinstance(bucket_size, bool) or bucket_size < 1:
            raise ValueError(f"bucket_size: must be a number of elements >= 1 (got {bucket_size!r})")
        self.offload = bool(offload)
        self.bucket_size = int(bucket_size)
        # DeepSpeed's engine calls ``step()`` and expects the variant chosen here
        self.step = self._step_with_offload if self.offload else self._step_without_offload

    # -- where the slice lives (subclasses) ---------------------------------------------------------------

    @abc.abstractmethod
    def _base(self, param: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """The tensor holding ``param``'s values and the axis ``selected_indices`` index (None: whole)."""

    def _acquire(self, param: torch.Tensor) -> bool:
        """Make the storage resident; True when the caller must ``_release`` it afterwards."""
        return False

    def _release(self, param: torch.Tensor, acquired: bool, *, dirty: bool) -> None:
        """Undo ``_acquire``; ``dirty`` says whether the values changed and must be persisted."""

    # -- reading and writing the slice --------------------------------------------------------------------

    def _read_slice(self, param: torch.Tensor, device: torch.device) -> torch.Tensor:
        base, axis = self._base(param)
        if axis is None:
            return base.detach().to(device, copy=True)
        index = param.selected_indices.to(base.device)
        return base.detach().index_select(axis, index).to(device)

    def _write_slice(self, param: torch.Tensor, values: torch.Tensor) -> None:
        base, axis = self._base(param)
        values = values.to(base.device, base.dtype)
        if axis is None:
            base.copy_(values.view_as(base))
        else:
            base.index_copy_(axis, param.selected_indices.to(base.device), values)

    def _start_slice(self, param: torch.Tensor) -> torch.Tensor:
        """The values the update starts from: the snapshot when there is one, else the live slice."""
        device = param.selected_grad.device
        snapshot = getattr(param, "temp_selected_param", None)
        if snapshot is None:
            return self._read_slice(param, device)
        base, _ = self._base(param)
        return snapshot.detach().to(device, base.dtype, copy=True)

    # -- moments -------------------------------------------------------------------------------------------

    def copy_mv_from_cpu(self, params: Iterable[torch.Tensor]) -> None:
        """Bring the offloaded moments of ``params`` to their gradient's device (``p.exp_avg``/``p.exp_avg_sq``)."""
        for p in params:
            if not hasattr(p, "exp_avg_cpu_data"):  # first step: the engine did not pre-allocate them
                p.exp_avg_cpu_data = torch.zeros(p.selected_grad.shape, dtype=p.selected_grad.dtype)
                p.exp_avg_sq_cpu_data = torch.zeros_like(p.exp_avg_cpu_data)
            device = p.selected_grad.device
            p.exp_avg = p.exp_avg_cpu_data.to(device, copy=True)
            p.exp_avg_sq = p.exp_avg_sq_cpu_data.to(device, copy=True)

    def copy_mv_to_cpu(self, params: Iterable[torch.Tensor]) -> None:
        """Write the device moments back to the host buffers and drop the device copies."""
        for p in params:
            p.exp_avg_cpu_data.copy_(p.exp_avg.reshape_as(p.exp_avg_cpu_data))
            p.exp_avg_sq_cpu_data.copy_(p.exp_avg_sq.reshape_as(p.exp_avg_sq_cpu_data))
            p.exp_avg = None
            p.exp_avg_sq = None

    def clear_selected_mv(self) -> None:
        """Zero the moments of every parameter that has taken a step (ZenFlow does this on re-selection,
        when the slices change meaning)."""
        logger.info("ZenFlow: clearing the selective optimizer's moments")
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                if self.offload:
                    if hasattr(p, "exp_avg_cpu_data"):
                        p.exp_avg_cpu_data.zero_()
                        p.exp_avg_sq_cpu_data.zero_()
                else:
                    state["exp_avg"].zero_()
                    state["exp_avg_sq"].zero_()

    # -- the update ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        """One AdamW step on the selected slices of ``params`` (all of ``group``), written back in place."""
        params = [p for p in params if _has_selection(p)]
        if not params:
            return
        acquired = [self._acquire(p) for p in params]
        if self.offload:
            self.copy_mv_from_cpu(params)
        slices, grads, avgs, sqs, maxes, steps = [], [], [], [], [], []
        for p in params:
            piece = self._start_slice(p)
            grad = p.selected_grad.to(piece.device, piece.dtype).reshape_as(piece)
            state = self.state[p]
            if "step" not in state:
                # a float32 host counter, as torch's AdamW keeps it (a bf16 counter would stall at 256)
                state["step"] = torch.zeros((), dtype=torch.float32)
                if not self.offload:
                    state["exp_avg"] = torch.zeros_like(piece)
                    state["exp_avg_sq"] = torch.zeros_like(piece)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(piece)
            if self.offload:
                p.exp_avg, p.exp_avg_sq = p.exp_avg.reshape_as(piece), p.exp_avg_sq.reshape_as(piece)
                avgs.append(p.exp_avg)
                sqs.append(p.exp_avg_sq)
            else:
                avgs.append(state["exp_avg"])
                sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                maxes.append(state["max_exp_avg_sq"])
            slices.append(piece)
            grads.append(grad)
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        _adamw(slices, grads, avgs, sqs, maxes, steps, foreach=slices[0].device.type != "cpu",
               amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
               weight_decay=group["weight_decay"], eps=group["eps"], maximize=group.get("maximize", False))
        for p, piece, held in zip(params, slices, acquired, strict=True):
            self._write_slice(p, piece)
            self._release(p, held, dirty=True)
            p.selected_grad = None
            p.temp_selected_param = None
        if self.offload:
            self.copy_mv_to_cpu(params)

    def _update_params(self, group: dict, params: list[torch.Tensor]) -> None:
        self._update(group, params)

    @torch.no_grad()
    def _step_without_offload(self, closure=None):
        """Update every parameter that carries a selection, one AdamW call per group."""
        loss = None if closure is None else closure()
        for group in self.param_groups:
            self._update_params(group, list(group["params"]))
        return loss

    @torch.no_grad()
    def _step_with_offload(self, closure=None):
        """As ``_step_without_offload``, in buckets of about ``bucket_size`` slice elements so that only one
        bucket's moments sit on the device at a time."""
        loss = None if closure is None else closure()
        for group in self.param_groups:
            bucket, numel = [], 0
            for p in group["params"]:
                if not _has_selection(p):
                    continue
                bucket.append(p)
                numel += p.selected_grad.numel()
                if numel >= self.bucket_size:
                    self._update_params(group, bucket)
                    bucket, numel = [], 0
            self._update_params(group, bucket)
        return loss

    @torch.no_grad()
    def _snapshot(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            if not _has_selection(p):
                continue
            held = self._acquire(p)
            base, _ = self._base(p)
            snapshot = self._read_slice(p, base.device)
            p.temp_selected_param = snapshot.cpu() if self.offload else snapshot
            self._release(p, held, dirty=False)


class ZenFlowSelectiveAdamW(_SelectiveAdamW):
    """Selective AdamW for ZeRO stages 1/2: ``selected_indices`` pick columns (dim 1) of each weight."""

    def _base(self, param: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        return param.data, (1 if param.dim() > 1 else None)

    def temp_copy_param(self, group_to_paramlist: Mapping[int, Iterable[torch.Tensor]]) -> None:
        """Snapshot the selected columns of the given parameters (``{group index: [params]}``)."""
        for params in group_to_paramlist.values():
            self._snapshot(params)

    def group_step(self, group_to_paramlist: Mapping[int, Iterable[torch.Tensor]]) -> None:
        """Update the given parameters only (``{group index: [params]}``) with their group's settings."""
        for group_id, params in group_to_paramlist.items():
            self._update_params(self.param_groups[group_id], list(params))


class ZenFlowSelectiveAdamW_stage3(_SelectiveAdamW):  # noqa: N801 -- DeepSpeed's name
    """Selective AdamW for ZeRO-3: the slice is in the parameter's partition ``ds_tensor``.

    The partition holds the weight transposed: ``ds_tensor[complete_column_offset:][:complete_numel]``
    viewed as ``(-1, ds_shape[1])`` has one row per column of the weight, and ``selected_indices`` pick rows.
    A partition may sit on another device than the gradient (CPU offload): the math runs on the gradient's
    device and the result goes back to the partition's. A partition on NVMe (``ds_tensor`` a 0-dim
    placeholder, ``param.nvme_swapper`` set) is swapped in for its own update and swapped out after it, so
    one partition at a time is resident.
    """

    def _base(self, param: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        data = param.ds_tensor.data
        shape = tuple(param.ds_shape)
        width = shape[1] if len(shape) > 1 else 1
        if width == 1:
            return data, None
        offset = getattr(param, "complete_column_offset", 0)
        numel = getattr(param, "complete_numel", data.numel() - offset)
        return data.narrow(0, offset, numel).view(numel // width, width), 0

    def _on_nvme(self, param: torch.Tensor) -> bool:
        return param.ds_tensor.data.dim() == 0 and getattr(param, "nvme_swapper", None) is not None

    def _acquire(self, param: torch.Tensor) -> bool:
        if not self._on_nvme(param):
            return False
        param.nvme_swapper.swap_in([param], async_op=False)
        return True

    def _release(self, param: torch.Tensor, acquired: bool, *, dirty: bool) -> None:
        if not acquired:
            return
        if dirty:
            param.nvme_swapper.swap_out_and_release([param])
        else:  # read only: the copy on NVMe is still current
            param.nvme_swapper.remove_partition_and_release_buffers([param])

    def _update_params(self, group: dict, params: list[torch.Tensor]) -> None:
        # NVMe partitions one by one (the swapper's buffer pool holds few), the resident ones in one call
        swapped = [p for p in params if _has_selection(p) and self._on_nvme(p)]
        for p in swapped:
            self._update(group, [p])
        self._update(group, [p for p in params if not any(p is s for s in swapped)])

    def temp_copy_param(self, paramlist: Iterable[torch.Tensor]) -> None:
        """Snapshot the selected rows of the given parameters' partitions."""
        self._snapshot(paramlist)

    def group_step(self, paramlist: Iterable[torch.Tensor]) -> None:
        """Update the given parameters only, each with the settings of its group (``param.group_id``)."""
        by_group: dict[int, list[torch.Tensor]] = {}
        for p in paramlist:
            by_group.setdefault(p.group_id, []).append(p)
        for group_id in sorted(by_group):
            self._update_params(self.param_groups[group_id], by_group[group_id])
