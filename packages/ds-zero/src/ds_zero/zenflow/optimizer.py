"""ZenFlow under ZeRO stages 1/2 with CPU optimizer offload: the important columns every step, the rest
every ``update_interval`` steps.

Every ``step()`` (one engine optimizer step, which averages the gradients over the ranks) is one ZenFlow step
``t``, counted from 0. ``W = full_warm_up_rounds``, ``U = update_interval``, ``S`` = the selection interval in
steps (``select_interval``, times ``steps_per_epoch`` for the epoch strategies; 0 = select once).

- ``t < W``: a full offloaded step with this step's gradients, nothing selective.
- Selection boundary (``t == W``, or ``t > W`` with ``S`` dividing ``t``): the fp32 master partitions are
  refreshed from the model weights, so they carry the selective progress. The selective moments are
  cleared, and the columns are re-picked from this step's gradients (``ds_zero.zenflow.selection``).
- ``t >= W``: each rank gets the selected columns' averaged gradient. Off an update boundary, the
  selective AdamW (``ds_ops.adam.ZenFlowSelectiveAdamW``) updates those columns of the model weights at
  once.
- Update boundary (``t + 1 < W``, or ``U`` divides ``t + 1 - W``, or ``S`` divides ``t + 1``): the
  selected columns are snapshotted. The CPU optimizer then takes the full step on the mean of the
  gradients gathered since the last full step, and the result is gathered into the model weights. Last,
  the snapshot goes back into the selected columns and takes this step's selective update, so the full
  step only moves the columns outside the selection.

Every rank holds the same selected gradients and the same weights, so the selective steps stay identical
on all of them without further communication. The selective moments and the pending gradient window are
not part of checkpoints (nor are they in DeepSpeed).
"""

from __future__ import annotations

from typing import Any

import torch

from ds_ops.adam import ZenFlowSelectiveAdamW
from ds_zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from ds_zero.zenflow.plan import ZenFlowPlan
from ds_zero.zenflow.selection import gather_selected_grads, select_columns

__all__ = ["ZenFlowZeroOptimizer"]


class ZenFlowZeroOptimizer(DeepSpeedZeroOptimizer):
    """``DeepSpeedZeroOptimizer`` (stage 1/2, CPU offload) driven by a :class:`ZenFlowPlan`."""

    def __init__(self, *args: Any, zenflow: ZenFlowPlan, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plan = zenflow
        self.zenflow_step_id = 0
        self._selections: list[Any] | None = None
        self._window: list[torch.Tensor] = []
        self._window_steps = 0
        self._full_grads: list[torch.Tensor] | None = None
        hyper = ("lr", "betas", "eps", "weight_decay")
        self.selective_optimizer = ZenFlowSelectiveAdamW(
            [{"params": list(fg.params), **{k: group[k] for k in hyper if k in group}}
             for fg, group in zip(self.groups, self.optimizer.param_groups, strict=True)],
            offload=zenflow.offload, bucket_size=max(1, self.settings.allgather_bucket_numel))

    def set_steps_per_epoch(self, steps: int) -> None:
        """Count the 'epoch'/'auto' selection interval in steps of an epoch of ``steps`` (the engine calls this
        once its training dataloader exists, as DeepSpeed sets ``zenflow.steps_per_epoch``)."""
        self.plan = self.plan.for_epoch_length(steps)

    # ---- the full step reads the window's mean instead of this step's gradients ---------------------------
    def _step_grads(self) -> list[torch.Tensor]:
        return self._full_grads if self._full_grads is not None else super()._step_grads()

    def _accumulate(self, grads: list[torch.Tensor]) -> None:
        if not self._window:
            self._window = [torch.zeros_like(g) for g in grads]
        for acc, g in zip(self._window, grads, strict=True):
            acc.add_(g)
        self._window_steps += 1

    def _clear_window(self) -> None:
        for acc in self._window:
            acc.zero_()
        self._window_steps = 0

    def _sync_lr(self) -> None:
        for selective, group in zip(self.selective_optimizer.param_groups, self.optimizer.param_groups, strict=True):
            selective["lr"] = group["lr"]

    def _clear_selection_inputs(self) -> None:
        for fg in self.groups:
            for p in fg.params:
                p.selected_grad = p.temp_selected_param = None

    # ---- one ZenFlow step ----------------------------------------------------------------------------------
    def step(self) -> bool:
        self._ensure_partitions()
        t, plan = self.zenflow_step_id, self.plan
        self.zenflow_step_id += 1
        grads = super()._step_grads()
        selective = t >= plan.full_warm_up_rounds
        if selective and plan.selects_at(t):
            if t > 0:
                self.sync_master_from_model()
            self.selective_optimizer.clear_selected_mv()
            self._selections = [select_columns(fg, g, plan.topk_ratio, self.comm)
                                for fg, g in zip(self.groups, grads, strict=True)]
        if selective:
            for sel, fg, g in zip(self._selections, self.groups, grads, strict=True):
                gather_selected_grads(sel, fg, g, self.comm)
            self._sync_lr()
        self._accumulate(grads)
        if not plan.updates_at(t):
            self.selective_optimizer.step()
            self.overflow, self.global_grad_norm = False, None
            return self._stepped()
        if selective:
            self.selective_optimizer.temp_copy_param({i: fg.params for i, fg in enumerate(self.groups)})
        self._full_grads = [acc / self._window_steps for acc in self._window]
        try:
            stepped = super().step()
        finally:
            self._full_grads = None
            self._clear_window()
        if stepped and selective:
            self.selective_optimizer.step()
        self._clear_selection_inputs()
        return stepped
