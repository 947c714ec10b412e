"""FusedLion: Lion on torch's multi-tensor (``torch._foreach_*``) kernels, for CUDA and CPU tensors."""

from __future__ import annotations

from collections.abc import Iterable

from ds_ops import reference
from ds_ops.fused_common import FusedOptimizer
from ds_ops.validate import check_group


class FusedLion(FusedOptimizer):
    """DeepSpeed's FusedLion: a handful of multi-tensor launches per group; state ``step``, ``exp_avg``."""

    NAME = "FusedLion"
    STATES = ("exp_avg",)

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        check_group("FusedLion", defaults)
        super().__init__(params, defaults)
        self.set_grad_none = bool(set_grad_none)

    def _step_groups(self) -> None:
        for group in self.param_groups:
            b = self._gather(group)
            if b.params:
                beta1, beta2 = group["betas"]
                reference.lion_update(b.params, b.grads, b.states["exp_avg"], lr=group["lr"], beta1=beta1,
                                       beta2=beta2, weight_decay=group["weight_decay"])
