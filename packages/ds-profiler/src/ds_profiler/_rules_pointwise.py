"""Cost rules for ops without multiply-accumulates: elementwise, activations, normalizations, softmax,
reductions, pooling, interpolation, dropout, embedding, and the backward kernels of these.

These report FLOPs only (MACs = 0). Where DeepSpeed's flops profiler has a convention it is followed:
activations and softmax 1 FLOP per element, pooling 1 per input element, layer/group/instance norm 5 per
element with an affine transform (4 without), batch norm in eval 2 (1), embedding lookups 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

Cost = tuple[int, int]
Rule = Callable[[Sequence[Any], dict, Any], Cost]

# Interpolation taps per output element: nearest copies one input, linear modes blend 2 per dimension.
UPSAMPLE_TAPS = {"nearest": 1, "linear": 2, "bilinear": 4, "trilinear": 8, "bicubic": 16}


def first_tensor(value: Any) -> Any:
    """The first tensor in an op's output (ops may return tuples with ``None`` holes)."""
    if isinstance(value, (tuple, list)):
        for item in value:
            found = first_tensor(item)
            if found is not None:
                return found
        return None
    return value if hasattr(value, "numel") else None


def per_output(factor: int) -> Rule:
    """``factor`` FLOPs per element of the (first) output."""

    def rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
        return 0, factor * first_tensor(out).numel()

    rule.__doc__ = f"{factor} FLOP(s) per output element."
    return rule


def per_input(factor: int) -> Rule:
    """``factor`` FLOPs per element of the first argument (reductions, pooling, backward kernels)."""

    def rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
        return 0, factor * args[0].numel()

    rule.__doc__ = f"{factor} FLOP(s) per element of the first argument."
    return rule


def zero_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """Data movement only (embedding lookup): no arithmetic."""
    return 0, 0


def _affine_factor(weight: Any, with_affine: int, without: int) -> int:
    return with_affine if weight is not None else without


def layer_norm_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``native_layer_norm(x, shape, weight, bias, eps)``: 5 FLOPs/element with affine, else 4."""
    return 0, args[0].numel() * _affine_factor(args[2] if len(args) > 2 else None, 5, 4)


def group_norm_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``native_group_norm(x, weight, bias, ...)``: 5 FLOPs/element with affine, else 4."""
    return 0, args[0].numel() * _affine_factor(args[1], 5, 4)


def _batch_norm_cost(x: Any, weight: Any, training: bool) -> Cost:
    # Training computes statistics (like layer norm); eval only applies the stored affine normalization.
    factor = _affine_factor(weight, 5, 4) if training else _affine_factor(weight, 2, 1)
    return 0, x.numel() * factor


def batch_norm_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``native_batch_norm/cudnn_batch_norm(x, w, b, mean, var, training, ...)``; instance norm lands here."""
    return _batch_norm_cost(args[0], args[1], bool(args[5]))


def batch_norm_train_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``_batch_norm_with_update``: training statistics."""
    return _batch_norm_cost(args[0], args[1], True)


def batch_norm_eval_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``_native_batch_norm_legit_no_training`` / ``_batch_norm_no_update``: stored statistics."""
    return _batch_norm_cost(args[0], args[1], False)


def batch_norm_legit_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``_native_batch_norm_legit(x, w, b, mean, var, training, ...)`` or the stats-free overload."""
    training = bool(args[5]) if len(args) > 5 else bool(args[3])
    return _batch_norm_cost(args[0], args[1], training)


def rms_norm_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``_fused_rms_norm(x, shape, weight, eps)``: square, mean, scale (3/element), eps add and rsqrt per row,
    weight multiply (1/element): the same count as torch's decomposed ``F.rms_norm``."""
    x, shape = args[0], args[1]
    rows = x.numel() // max(1, math.prod(shape))
    weight = args[2] if len(args) > 2 else None
    return 0, 3 * x.numel() + 2 * rows + (x.numel() if weight is not None else 0)


def native_dropout_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``native_dropout(x, p, train)``: mask scaling and multiply (2/element) when training, else 0."""
    train = args[2] if len(args) > 2 else kwargs.get("train")
    return 0, 0 if train is False else 2 * args[0].numel()


def upsample_rule(mode: str) -> Rule:
    """Interpolation: nearest 1 FLOP per output element, linear modes a multiply and add per tap."""
    taps = UPSAMPLE_TAPS[mode]
    factor = 1 if taps == 1 else 2 * taps

    def rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
        return 0, factor * first_tensor(out).numel()

    rule.__doc__ = f"upsample ({mode}): {factor} FLOP(s) per output element."
    return rule


def embedding_bag_rule(args: Sequence[Any], kwargs: dict, out: Any) -> Cost:
    """``_embedding_bag(weight, indices, ...)``: one add per gathered element."""
    return 0, args[1].numel() * args[0].shape[-1]
