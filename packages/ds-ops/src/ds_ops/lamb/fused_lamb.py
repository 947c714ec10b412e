"""FusedLamb: LAMB on torch's multi-tensor (``torch._foreach_*``) kernels, for CUDA and CPU tensors."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ds_ops.fused_common import FusedOptimizer
from ds_ops.validate import check_group


class FusedLamb(FusedOptimizer):
    """LAMB (You et al. 2019) with DeepSpeed's FusedLamb arguments.

    Per tensor: ``m, v`` as in Adam; ``u = m_hat / denom + weight_decay * p`` where ``denom`` is
    ``sqrt(v_hat + eps)`` with ``eps_inside_sqrt`` else ``sqrt(v_hat) + eps`` (hats: bias-corrected when
    ``bias_correction``); trust ratio ``||p|| / ||u||`` clamped to ``[min_coeff, max_coeff]`` (1 when a
    norm is 0); ``p -= lr * ratio * u``. ``max_grad_norm > 0`` first scales all grads of the step by
    ``1 / clip`` when ``clip = (global_norm + 1e-6) / max_grad_norm`` exceeds 1. No host sync per step.
    ``get_lamb_coeffs()`` returns the last step's trust ratios.
    """

    NAME = "FusedLamb"
    STATES = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False) -> None:
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, max_coeff=max_coeff, min_coeff=min_coeff, amsgrad=amsgrad)
        check_group("FusedLamb", defaults)
        if max_grad_norm < 0 or not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"FusedLamb: max_grad_norm={max_grad_norm!r}, min_coeff={min_coeff!r}, "
                             f"max_coeff={max_coeff!r} are invalid; expected max_grad_norm >= 0 and "
                             "0 <= min_coeff <= max_coeff")
        super().__init__(params, defaults)
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        self.lamb_coeffs: list[torch.Tensor] = []

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios applied by the last step, one per updated param."""
        return [float(c) for c in self.lamb_coeffs]

    def _step_groups(self) -> None:
        self.lamb_coeffs = []
        work = [(group, self._gather(group)) for group in self.param_groups]
        all_grads = [g for _, b in work for g in b.grads]  # clipping uses the norm over every group's grads
        for group, b in work:
            if b.params:
                grads = self._clipped(b.grads, all_grads, group["max_grad_norm"])
                self.lamb_coeffs.extend(self._update(group, b.params, grads, b.states["exp_avg"],
                                                     b.states["exp_avg_sq"], b.steps))

    @staticmethod
    def _clipped(grads: list, all_grads: list, max_grad_norm: float) -> list:
        if max_grad_norm <= 0:
            return grads
        total = torch.linalg.vector_norm(torch.stack([n.float().to(grads[0].device)
                                                      for n in torch._foreach_norm(all_grads)]))
        clip = (total + 1e-6) / max_grad_norm
        scale = torch.where(clip > 1, 1.0 / clip, torch.ones_like(clip))
        return torch._foreach_mul(grads, scale)

    def _update(self, group: dict[str, Any], params: list, grads: list, exp_avgs: list, exp_avg_sqs: list,
                steps: list[int]) -> list[torch.Tensor]:
        beta1, beta2 = group["betas"]
        bc1 = [1.0 - beta1**s if group["bias_correction"] else 1.0 for s in steps]
        bc2 = [1.0 - beta2**s if group["bias_correction"] else 1.0 for s in steps]
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        v_hat = torch._foreach_div(exp_avg_sqs, bc2)
        if self.eps_inside_sqrt:
            torch._foreach_add_(v_hat, group["eps"])
            denom = torch._foreach_sqrt(v_hat)
        else:
            denom = torch._foreach_sqrt(v_hat)
            torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(exp_avgs, bc1)
        torch._foreach_div_(update, denom)
        if group["weight_decay"]:
            torch._foreach_add_(update, params, alpha=group["weight_decay"])
        w_norm = torch.stack(torch._foreach_norm(params))
        u_norm = torch.stack(torch._foreach_norm(update))
        ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
        ratio = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
        coeffs = list(ratio.unbind())
        torch._foreach_mul_(update, coeffs)
        torch._foreach_add_(params, update, alpha=-group["lr"])
        return coeffs
