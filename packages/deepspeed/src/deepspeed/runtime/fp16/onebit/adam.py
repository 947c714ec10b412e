"""1-bit Adam (DeepSpeed's ``OnebitAdam``): Adam whose communication is 1-bit compressed after a warm-up.

Warm-up (the first ``freeze_step`` steps): gradients are averaged over the data-parallel group at full
precision and both moments update as in Adam. Then the variance ``exp_avg_sq`` is frozen and each rank
updates its momentum with its *local* gradient; the momentum is averaged with the 1-bit compressed all-reduce
(worker and server error feedback, ``deepspeed.runtime.comm.compressed``), so every rank applies the same
update. As in DeepSpeed the update has no bias correction (``exp_avg / (sqrt(exp_avg_sq) + eps)``, plus
``weight_decay * p``); ``bias_correction``, ``eps_inside_sqrt`` and ``max_grad_norm`` are accepted and ignored
as there. Unlike DeepSpeed (which resets them on load), the error-feedback buffers are part of the
optimizer state and are restored from a checkpoint, so a resumed run continues exactly (the engine saves each
rank's buffers in its own file, ``_engine``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from deepspeed.runtime.fp16.onebit._common import OnebitOptimizer, average_full_precision_, distributed


class OnebitAdam(OnebitOptimizer):
    """1-bit Adam over ``params``; ``comm_group`` (default: the world) is the data-parallel group the engine sets.

    ``deepspeed`` (the engine, in DeepSpeed's signature) is accepted and not needed. ``cuda_aware`` only
    matters for DeepSpeed's MPI backend; ``comm_backend_name`` other than nccl/hccl logs a note (see ``_common``).
    """

    variant = "1-bit Adam"

    def __init__(self, params: Iterable, deepspeed: Any = None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl") -> None:
        if int(freeze_step) < 0:
            raise ValueError(f"freeze_step must be >= 0, got {freeze_step}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, deepspeed=deepspeed, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name, eps_inside_sqrt=eps_inside_sqrt, amsgrad=amsgrad)
        self.freeze_step = int(freeze_step)
        self.adam_freeze_key = False  # True once compression is on (DeepSpeed's attribute name)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._closure(closure)
        params = self._params()
        for _, p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        talk = distributed(self.comm_group)
        if not self.adam_freeze_key:
            if talk:
                average_full_precision_([p.grad for _, p in params], self.comm_group, "onebit_warmup_allreduce")
            for group, p in params:
                beta1, beta2 = group["betas"]
                state = self.state[p]
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        else:
            for group, p in params:
                self.state[p]["exp_avg"].mul_(group["betas"][0]).add_(p.grad, alpha=1 - group["betas"][0])
            if talk:
                self._comm().average_([self.state[p]["exp_avg"] for _, p in params], self.comm_group)
        for group, p in params:
            state = self.state[p]
            state["step"] += 1
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update.add_(p, alpha=group["weight_decay"])
            p.add_(update, alpha=-group["lr"])
        if not self.adam_freeze_key and params and self.state[params[0][1]]["step"] >= self.freeze_step:
            self.adam_freeze_key = True  # from the next step on, compressed momentum
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the moments, steps and error-feedback buffers; the stage follows the restored step."""
        super().load_state_dict(state_dict)
        first = self.state.get(self.param_groups[0]["params"][0], {})
        self.adam_freeze_key = int(first.get("step", 0)) >= self.freeze_step
