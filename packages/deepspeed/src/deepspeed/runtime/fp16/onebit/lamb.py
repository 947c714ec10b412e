"""1-bit LAMB (DeepSpeed's ``OnebitLamb``, arXiv:2104.06069): LAMB whose communication is 1-bit compressed after
a warm-up, with frozen-then-rescaled layer-wise coefficients.

Warm-up (the first ``freeze_step`` steps): gradients are averaged at full precision and each parameter takes a
LAMB step, ``p -= lr * coeff * (exp_avg / (sqrt(exp_avg_sq) + eps) + weight_decay * p)`` with
``coeff = ||p|| / ||update||`` clipped to [``min_coeff``, ``max_coeff``] (1 when either norm is 0); a running
average of the coefficients (``coeff_beta``) becomes the frozen coefficient ``lamb_coeff_freeze``. At
``freeze_step`` the variance is frozen (a copy, ``exp_avg_sq_fresh``, keeps tracking). Compression stage: each
rank updates its momentum with its local gradient, scaled by ``scaling_coeff`` (computed once: the mean of the
momenta's RMS over the per-parameter RMS, so one flat 1-bit compression treats every parameter alike), and
the momenta are averaged with the compressed all-reduce (error feedback, ``deepspeed.runtime.comm.
compressed``). The gradient reconstructed from the averaged momentum updates ``exp_avg_sq_fresh``; the
coefficient is ``lamb_coeff_freeze * factor``, ``factor = max(frozen denominator / fresh denominator)``
(blended towards 1 by the share of weight decay in the update), clipped to [``factor_min``, ``factor_max``]
and to within ``factor_threshold`` of the previous step's factor. No bias correction (``bias_correction``,
``eps_inside_sqrt`` and ``max_grad_norm`` are accepted and ignored, as in DeepSpeed). Unlike DeepSpeed (which
resets them on load and spends a no-op first step allocating buffers), the error-feedback buffers are restored
from a checkpoint (``_engine``), so a resumed run continues exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from deepspeed.runtime.fp16.onebit._common import OnebitOptimizer, apply_mask_, average_full_precision_, distributed


class OnebitLamb(OnebitOptimizer):
    """1-bit LAMB over ``params`` (DeepSpeed's signature and defaults); ``deepspeed``, ``cuda_aware`` and
    ``comm_backend_name`` as for ``OnebitAdam``. ``lamb_coeffs`` / ``get_lamb_coeffs()``: the last step's
    coefficients, one per parameter."""

    variant = "1-bit Lamb"

    def __init__(self, params: Iterable, deepspeed: Any = None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1) -> None:
        if int(freeze_step) < 0:
            raise ValueError(f"freeze_step must be >= 0, got {freeze_step}")
        if not 0 < min_coeff <= max_coeff or not 0 < factor_min <= factor_max:
            raise ValueError(f"need 0 < min_coeff <= max_coeff and 0 < factor_min <= factor_max, got "
                             f"{min_coeff}, {max_coeff}, {factor_min}, {factor_max}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults, deepspeed=deepspeed, cuda_aware=cuda_aware,
                         comm_backend_name=comm_backend_name, eps_inside_sqrt=eps_inside_sqrt, amsgrad=amsgrad)
        self.freeze_step = int(freeze_step)
        self.coeff_beta = float(coeff_beta)
        self.factor_max = float(factor_max)
        self.factor_min = float(factor_min)
        self.factor_threshold = float(factor_threshold)
        self.lamb_freeze_key = False  # True once compression is on (DeepSpeed's attribute name)
        self.lamb_coeffs: list[float] = []

    def get_lamb_coeffs(self) -> list[float]:
        # a copy: the next step() refills the list in place, which would empty the caller's
        return list(self.lamb_coeffs)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._closure(closure)
        params = self._params()
        self.lamb_coeffs = []
        for _, p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = 0
                state["lamb_coeff_freeze"] = 0.0
                state["last_factor"] = 1.0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if not params:
            return loss
        if self.lamb_freeze_key:
            self._compressed_step(params)
        else:
            self._warmup_step(params)
        if not self.lamb_freeze_key and self.state[params[0][1]]["step"] >= self.freeze_step:
            self.lamb_freeze_key = True  # from the next step on, compressed momentum
        return loss

    def _warmup_step(self, params: list) -> None:
        """Plain LAMB on the full-precision average; the running average of the coefficients."""
        if distributed(self.comm_group):
            average_full_precision_([p.grad for _, p in params], self.comm_group, "onebit_lamb_warmup_allreduce")
        for group, p in params:
            beta1, beta2 = group["betas"]
            state = self.state[p]
            state["step"] += 1
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            if state["step"] == self.freeze_step:
                state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
            update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"] > 0.0:
                update.add_(p, alpha=group["weight_decay"])
            weight_norm, update_norm = float(p.norm()), float(update.norm())
            coeff = 1.0
            if weight_norm != 0 and update_norm != 0:
                coeff = min(max(weight_norm / update_norm, group["min_coeff"]), group["max_coeff"])
            if coeff != 1.0:
                frozen = state["lamb_coeff_freeze"]
                state["lamb_coeff_freeze"] = self.coeff_beta * frozen + (1 - self.coeff_beta) * coeff
            self.lamb_coeffs.append(coeff)
            p.add_(update, alpha=-group["lr"] * coeff)

    def _scaling_coeffs(self, params: list) -> None:
        """Once, at the first compressed step: ``scaling_coeff`` = mean momentum RMS / this momentum's RMS."""
        rms = [float(self.state[p]["exp_avg"].norm()) / math.sqrt(max(1, p.numel())) for _, p in params]
        united = sum(rms) / len(rms)
        for (_, p), r in zip(params, rms, strict=True):
            self.state[p]["scaling_coeff"] = united / r if r > 0 and united > 0 else 1.0

    def _compressed_step(self, params: list) -> None:
        if "scaling_coeff" not in self.state[params[0][1]]:
            self._scaling_coeffs(params)
        last = [self.state[p]["exp_avg"].clone() for _, p in params]
        for group, p in params:
            state = self.state[p]
            state["exp_avg"].mul_(group["betas"][0]).add_(p.grad, alpha=1 - group["betas"][0])
            state["exp_avg"].mul_(state["scaling_coeff"])
        if distributed(self.comm_group):
            self._comm().average_([self.state[p]["exp_avg"] for _, p in params], self.comm_group)
        for (group, p), previous in zip(params, last, strict=True):
            self._compressed_update(group, p, previous)

    def _factor(self, state: dict[str, Any], group: dict[str, Any], denom: torch.Tensor, prelim: torch.Tensor,
                update: torch.Tensor) -> float:
        """How far the frozen variance over-/under-states the fresh one, bounded and rate-limited."""
        factor = float((denom / (state["exp_avg_sq_fresh"].sqrt() + group["eps"])).max())
        if group["weight_decay"] > 0.0:
            update_norm = float(update.norm())
            ratio = min(1.0, float(prelim.norm()) / update_norm) if update_norm > 0 else 1.0
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, self.factor_min), self.factor_max)
        last = state["last_factor"]
        factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
        state["last_factor"] = factor
        return factor

    def _compressed_update(self, group: dict[str, Any], p: torch.Tensor, previous: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        state = self.state[p]
        state["step"] += 1
        exp_avg = state["exp_avg"].div_(state["scaling_coeff"])
        apply_mask_(group, exp_avg)
        if "exp_avg_sq_fresh" not in state:  # freeze_step 0, or a state from before the freeze
            state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
        grad = (exp_avg - previous * beta1) / (1 - beta1)  # the averaged gradient, reconstructed
        state["exp_avg_sq_fresh"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = state["exp_avg_sq"].sqrt() + group["eps"]
        prelim = exp_avg / denom
        update = prelim + p * group["weight_decay"] if group["weight_decay"] > 0.0 else prelim
        coeff = state["lamb_coeff_freeze"] * self._factor(state, group, denom, prelim, update)
        self.lamb_coeffs.append(coeff)
        p.add_(update, alpha=-group["lr"] * coeff)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore moments, coefficients and steps (the engine restores each rank's error buffers); the stage
        follows the restored step, and a warm-up state drops what only the compression stage uses."""
        self._keep_masks(state_dict)
        super().load_state_dict(state_dict)
        self.lamb_freeze_key = self._restored_step() >= max(1, self.freeze_step)
        if not self.lamb_freeze_key:
            for state in self.state.values():
                state.pop("scaling_coeff", None)
