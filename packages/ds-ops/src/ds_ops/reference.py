"""Pure-torch versions of the CPU optimizer updates: the fallback when the native op cannot be built
(allowed explicitly) and the plain reference the kernels are tested against.

All math runs in float32 on foreach lists; low-precision params/states are widened first and rounded
once when written back, which is what the native kernels do.
"""

from __future__ import annotations

import torch

Tensors = list[torch.Tensor]


def _f32(tensors: Tensors) -> Tensors:
    return [t if t.dtype == torch.float32 else t.float() for t in tensors]


def _write_back(targets: Tensors, values: Tensors) -> None:
    for target, value in zip(targets, values, strict=True):
        if target is not value:
            target.copy_(value)


def _apply_adam_step(p32: Tensors, m32: Tensors, v32: Tensors, steps: list[int], lr: float, beta1: float,
                     beta2: float, eps: float, bias_correction: bool, sign: float) -> None:
    """``p += sign * step_size * m / (sqrt(v) / sqrt(bc2) + eps)``: -1 takes Adam's step, +1 takes it back."""
    if bias_correction:
        step_sizes = [sign * lr / (1.0 - beta1**s) for s in steps]
        bc2_sqrt = [(1.0 - beta2**s) ** 0.5 for s in steps]
    else:
        step_sizes, bc2_sqrt = [sign * lr] * len(steps), [1.0] * len(steps)
    denom = torch._foreach_sqrt(v32)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(p32, m32, denom, step_sizes)


def adam_update(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, steps: list[int], *,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, bias_correction: bool,
                adamw_mode: bool) -> None:
    """Adam (L2 decay) or AdamW (decoupled decay) in place; ``steps`` are the 1-based step of each tensor."""
    p32, g32, m32, v32 = _f32(params), _f32(grads), _f32(exp_avgs), _f32(exp_avg_sqs)
    if weight_decay:
        if adamw_mode:
            torch._foreach_mul_(p32, 1.0 - lr * weight_decay)
        else:
            g32 = torch._foreach_add(g32, p32, alpha=weight_decay)
    torch._foreach_mul_(m32, beta1)
    torch._foreach_add_(m32, g32, alpha=1.0 - beta1)
    torch._foreach_mul_(v32, beta2)
    torch._foreach_addcmul_(v32, g32, g32, value=1.0 - beta2)
    _apply_adam_step(p32, m32, v32, steps, lr, beta1, beta2, eps, bias_correction, sign=-1.0)
    for targets, values in ((params, p32), (exp_avgs, m32), (exp_avg_sqs, v32)):
        _write_back(targets, values)


def adam_rollback(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, steps: list[int], *,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, bias_correction: bool,
                  adamw_mode: bool) -> None:
    """Undo :func:`adam_update` of step ``steps`` (the same gradients and hyper-parameters) in place: the
    parameters and both moments return to their values before that step, up to rounding."""
    p32, g32, m32, v32 = _f32(params), _f32(grads), _f32(exp_avgs), _f32(exp_avg_sqs)
    _apply_adam_step(p32, m32, v32, steps, lr, beta1, beta2, eps, bias_correction, sign=1.0)
    if weight_decay:
        if adamw_mode:
            torch._foreach_div_(p32, 1.0 - lr * weight_decay)
        else:
            g32 = torch._foreach_add(g32, p32, alpha=weight_decay)
    torch._foreach_addcmul_(v32, g32, g32, value=-(1.0 - beta2))
    torch._foreach_div_(v32, beta2)
    torch._foreach_clamp_min_(v32, 0.0)  # rounding must not leave a negative second moment
    torch._foreach_add_(m32, g32, alpha=-(1.0 - beta1))
    torch._foreach_div_(m32, beta1)
    for targets, values in ((params, p32), (exp_avgs, m32), (exp_avg_sqs, v32)):
        _write_back(targets, values)


def adagrad_update(params: Tensors, grads: Tensors, sums: Tensors, *, lr: float, eps: float,
                   weight_decay: float) -> None:
    """Adagrad (L2 decay, no lr decay) in place: sum += g^2; p -= lr * g / (sqrt(sum) + eps)."""
    p32, g32, s32 = _f32(params), _f32(grads), _f32(sums)
    if weight_decay:
        g32 = torch._foreach_add(g32, p32, alpha=weight_decay)
    torch._foreach_addcmul_(s32, g32, g32, value=1.0)
    denom = torch._foreach_sqrt(s32)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(p32, g32, denom, value=-lr)
    _write_back(params, p32)
    _write_back(sums, s32)


def lion_update(params: Tensors, grads: Tensors, exp_avgs: Tensors, *, lr: float, beta1: float, beta2: float,
                weight_decay: float) -> None:
    """Lion in place: p = p*(1 - lr*wd) - lr*sign(b1*m + (1-b1)*g); m = b2*m + (1-b2)*g."""
    p32, g32, m32 = _f32(params), _f32(grads), _f32(exp_avgs)
    if weight_decay:
        torch._foreach_mul_(p32, 1.0 - lr * weight_decay)
    direction = torch._foreach_mul(m32, beta1)
    torch._foreach_add_(direction, g32, alpha=1.0 - beta1)
    torch._foreach_sign_(direction)
    torch._foreach_add_(p32, direction, alpha=-lr)
    torch._foreach_mul_(m32, beta2)
    torch._foreach_add_(m32, g32, alpha=1.0 - beta2)
    _write_back(params, p32)
    _write_back(exp_avgs, m32)
