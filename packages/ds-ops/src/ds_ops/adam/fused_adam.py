"""FusedAdam: Adam/AdamW on torch's fused multi-tensor kernel (CUDA and CPU), no hand-written kernels."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adam import adam as _torch_adam

from ds_ops import reference
from ds_ops.fused_common import FusedOptimizer
from ds_ops.validate import check_group


class FusedAdam(FusedOptimizer):
    """DeepSpeed's FusedAdam: one fused launch per (device, dtype) for all params of a group.

    With ``bias_correction=True`` it calls torch's fused Adam/AdamW kernel (``torch._fused_adam(w)_``
    through ``torch.optim.adam.adam(fused=True)``), so its state (``step`` tensor, ``exp_avg``,
    ``exp_avg_sq`` in the param dtype) is exactly torch.optim.Adam's. ``bias_correction=False`` (which
    torch's kernel lacks) runs the multi-tensor ``torch._foreach_*`` update instead.
    """

    NAME = "FusedAdam"
    STATES = ("exp_avg", "exp_avg_sq")
    TENSOR_STEP = True
    SPARSE_HINT = "; use torch.optim.SparseAdam"

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad)
        check_group("FusedAdam", defaults)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = bool(set_grad_none)

    def _step_groups(self) -> None:
        for group in self.param_groups:
            b = self._gather(group)
            if b.params:
                self._update(group, b.params, b.grads, b.states["exp_avg"], b.states["exp_avg_sq"], b.steps)

    def _update(self, group: dict[str, Any], params: list, grads: list, exp_avgs: list, exp_avg_sqs: list,
                steps: list) -> None:
        beta1, beta2 = group["betas"]
        if group["bias_correction"]:
            _torch_adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True,
                        decoupled_weight_decay=self.adam_w_mode, amsgrad=False, beta1=beta1, beta2=beta2,
                        lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            return
        torch._foreach_add_(steps, 1)
        reference.adam_update(params, grads, exp_avgs, exp_avg_sqs, [1] * len(params), lr=group["lr"], beta1=beta1,
                               beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                               bias_correction=False, adamw_mode=self.adam_w_mode)
