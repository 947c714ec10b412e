"""FusedLion: Lion on torch's multi-tensor (``torch._foreach_*``) kernels, for CUDA and CPU tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ds_ops import _reference
from ds_ops._validate import check_group


class FusedLion(torch.optim.Optimizer):
    """DeepSpeed's FusedLion: a handful of multi-tensor launches per group; state ``step``, ``exp_avg``."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        check_group("FusedLion", defaults)
        super().__init__(params, defaults)
        self.set_grad_none = bool(set_grad_none)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            check_group("FusedLion", group)
            params, grads, exp_avgs = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("FusedLion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
            if params:
                beta1, beta2 = group["betas"]
                _reference.lion_update(params, grads, exp_avgs, lr=group["lr"], beta1=beta1, beta2=beta2,
                                       weight_decay=group["weight_decay"])
        return loss
