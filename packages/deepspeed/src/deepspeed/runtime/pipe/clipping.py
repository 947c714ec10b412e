"""Gradient clipping of a pipeline trained in bf16 with bf16 gradient accumulation, as DeepSpeed does it.

For that configuration (bf16, ZeRO 0, ``data_types.grad_accum_dtype`` unset or bf16) DeepSpeed's pipeline
engine uses ``BF16_Optimizer`` with bf16 gradient buffers: it clips the *bf16* gradients in place (each clipped
value rounded to bf16) and only then hands fp32 copies to the optimizer. The shared stage-0 wrapper upcasts
first and clips in fp32 (as DeepSpeed's non-pipeline bf16 path, ``FP16_Optimizer``, does), which gives other
last bits whenever clipping fires. The norm is the same everywhere: every stage's gradients (a tied weight's
copies counted once, replicated parameters once per tensor slice), summed over the model-parallel group; its
arithmetic here is DeepSpeed's (float32 squares of float32 norms summed in order, ``max_norm / (norm + 1e-6)``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from deepspeed.runtime.precision.optimizers import MixedPrecisionOptimizer
from ds_zero.grad_norm import counts_in_norm


def clips_bf16_grads(optimizer: Any, zero_stage: int, clip: float) -> bool:
    """True for the configuration DeepSpeed clips in bf16: bf16 weights accumulating bf16 gradients in their
    ``.grad``, no loss scaling, no ZeRO, clipping on."""
    return (isinstance(optimizer, MixedPrecisionOptimizer) and not optimizer.fp32_grad_accum
            and optimizer.loss_scaler is None and zero_stage == 0 and clip > 0 and bool(optimizer.model_params)
            and all(p.dtype == torch.bfloat16 for p in optimizer.model_params))


def clip_bf16_grads(optimizer: MixedPrecisionOptimizer, max_norm: float, device: torch.device) -> float:
    """Scale the bf16 gradients of ``optimizer``'s parameters in place by ``max_norm / (norm + 1e-6)`` when that
    is below 1; returns the norm. Every rank of the model-parallel group must call it."""
    with_grad = [p for p in optimizer.model_params if p.grad is not None]
    sumsq = torch.zeros((), dtype=torch.float32, device=device)
    for p in with_grad:
        if counts_in_norm(p, optimizer.norm_scope):
            sumsq.add_(p.grad.float().norm(2.0).to(device) ** 2.0)
    if optimizer.norm_scope.spans_ranks:
        dist.all_reduce(sumsq, group=optimizer.norm_scope.group)
    norm = sumsq.pow(1.0 / 2.0)
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for p in with_grad:
            p.grad.mul_(coef.to(p.grad.device))
    return float(norm)
