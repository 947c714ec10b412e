"""0/1 Adam (DeepSpeed's ``ZeroOneAdam``, arXiv:2202.06009): 1-bit Adam with adaptive variance freezing and
local steps.

Variance phase (steps 1..``var_freeze_step``): the variance ``exp_avg_sq`` updates only on steps that are a
multiple of ``var_interval``; those steps average the gradients at full precision and update both moments.
``var_interval`` starts at 1 and doubles after every ``var_update_scaler`` variance updates. On the other steps
the gradients are averaged with the 1-bit compressed all-reduce (error feedback, ``deepspeed.runtime.comm.
compressed``) and only the momentum updates. From step ``var_freeze_step + 1`` on the variance is frozen and
the error buffers restart from zero (they now hold momentum, not gradient, residue). Each rank then takes
*local* Adam steps with its own gradient and synchronises every ``local_step_interval`` steps: the displacement
since the last sync, rescaled by ``sqrt(exp_avg_sq) + eps``, is averaged with the compressed all-reduce; the
averaged displacement replaces every rank's (so all ranks agree again) and ``exp_avg = -displacement / lrs``
(``lrs``: the sum of the learning rates since the sync). ``local_step_interval`` starts at 1 and doubles every
``local_step_scaler`` steps, up to ``local_step_clipper``. The update has no bias correction, as DeepSpeed.

Differences from DeepSpeed, both deliberate: no no-op first "initialisation" step (DeepSpeed's first ``step``
allocates buffers and leaves the parameters unchanged); the state keeps the parameters at the last sync
(``last_sync_param``) instead of DeepSpeed's ``momentum_accumulator`` (same memory; the sum of local updates is
``param - last_sync_param``), so after a sync every rank holds bitwise the same parameters. Checkpoints restore
the state and each rank's error buffers exactly (``_engine``); a checkpoint taken between two syncs
(``local_step_interval > 1``) holds rank 0's parameters and local state, and every rank resumes from those.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from deepspeed.runtime.fp16.onebit._common import OnebitOptimizer, apply_mask_, average_full_precision_, distributed

_SCHEDULE = {"var_interval": 1, "var_counter": 0, "local_step_interval": 1, "local_step_counter": 0}


class ZeroOneAdam(OnebitOptimizer):
    """0/1 Adam over ``params`` (DeepSpeed's signature and defaults). ``bias_correction``, ``eps_inside_sqrt``
    and ``max_grad_norm`` are accepted and ignored as in DeepSpeed; ``deepspeed``, ``cuda_aware`` and
    ``comm_backend_name`` as for ``OnebitAdam``."""

    variant = "0/1 Adam"

    def __init__(self, params: Iterable, deepspeed: Any = None, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl") -> None:
        if int(var_freeze_step) < 0:
            raise ValueError(f"var_freeze_step must be >= 0, got {var_freeze_step}")
        for name, value in (("var_update_scaler", var_update_scaler), ("local_step_scaler", local_step_scaler),
                            ("local_step_clipper", local_step_clipper)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, deepspeed=deepspeed, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name, eps_inside_sqrt=eps_inside_sqrt, amsgrad=amsgrad)
        self.var_freeze_step = int(var_freeze_step)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler = int(local_step_scaler)
        self.local_step_clipper = int(local_step_clipper)
        self.var_freeze_key = False  # True once the variance is frozen (local steps)

    def _schedule(self) -> dict[str, Any]:
        head = self._head()
        for key, value in _SCHEDULE.items():
            head.setdefault(key, value)
        return head

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._closure(closure)
        params = self._params()
        if not params:
            return loss
        for _, p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        sched = self._schedule()
        step = self.state[params[0][1]]["step"] + 1
        if self.var_freeze_key:
            self._local_step(params, step, sched)
        else:
            self._variance_step(params, step, sched)
        for _, p in params:
            self.state[p]["step"] = step
        if not self.var_freeze_key and step >= self.var_freeze_step:
            self.var_freeze_key = True
            for key in ("worker_error", "server_error"):  # gradient residue; momentum from now on
                if key in sched:
                    sched[key].zero_()
        return loss

    def _variance_step(self, params: list, step: int, sched: dict[str, Any]) -> None:
        """Full-precision average and both moments every ``var_interval`` steps; else compressed, momentum only."""
        grads = [p.grad for _, p in params]
        talk = distributed(self.comm_group)
        update_var = step % sched["var_interval"] == 0
        if talk and update_var:
            average_full_precision_(grads, self.comm_group, "zoadam_variance_allreduce")
        elif talk:
            self._comm().average_(grads, self.comm_group)
            for group, p in params:
                apply_mask_(group, p.grad)
        for group, p in params:
            beta1, beta2 = group["betas"]
            state = self.state[p]
            if update_var:
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update.add_(p, alpha=group["weight_decay"])
            p.add_(update, alpha=-group["lr"])
        if update_var:
            sched["var_counter"] += 1
            if sched["var_counter"] == self.var_update_scaler:
                sched["var_counter"] = 0
                sched["var_interval"] *= 2

    def _local_step(self, params: list, step: int, sched: dict[str, Any]) -> None:
        """A local Adam step with the rank's own gradient; every ``local_step_interval`` steps, a 1-bit sync."""
        for group, p in params:
            beta1 = group["betas"][0]
            state = self.state[p]
            if "last_sync_param" not in state:
                state["last_sync_param"] = p.detach().clone()
                state["lrs"] = 0.0
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            state["lrs"] += group["lr"]
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update.add_(p, alpha=group["weight_decay"])
            p.add_(update, alpha=-group["lr"])
        if step % sched["local_step_interval"] == 0:
            self._sync(params)
        sched["local_step_counter"] += 1
        if sched["local_step_counter"] == self.local_step_scaler:
            sched["local_step_counter"] = 0
            sched["local_step_interval"] = min(self.local_step_clipper, sched["local_step_interval"] * 2)

    def _sync(self, params: list) -> None:
        """Average the variance-scaled displacements since the last sync; every rank applies the average."""
        moves = []
        for group, p in params:
            state = self.state[p]
            moves.append((p - state["last_sync_param"]).mul_(state["exp_avg_sq"].sqrt() + group["eps"]))
        if distributed(self.comm_group):
            self._comm().average_(moves, self.comm_group)
            for (group, _), move in zip(params, moves, strict=True):
                apply_mask_(group, move)
        for (group, p), move in zip(params, moves, strict=True):
            state = self.state[p]
            if state["lrs"] > 0:
                state["exp_avg"].copy_(move).div_(-state["lrs"])
            p.copy_(state["last_sync_param"]).add_(move / (state["exp_avg_sq"].sqrt() + group["eps"]))
            state["last_sync_param"].copy_(p)
            state["lrs"] = 0.0

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore moments, schedule and last-sync parameters (the engine restores each rank's error buffers);
        the phase follows the restored step."""
        self._keep_masks(state_dict)
        super().load_state_dict(state_dict)
        self.var_freeze_key = self._restored_step() >= max(1, self.var_freeze_step)
