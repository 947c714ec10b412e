"""Fake quantizers and the top-k mask binarizer of the compression library.

Every function returns a tensor of the input's shape and dtype holding values from the quantization grid
(quantize-dequantize), so the model keeps running in floating point while it sees quantized values. The autograd
wrappers pass gradients straight through (STE): quantization and masking are treated as the identity backwards,
which is what lets the weights and the top-k scores keep learning under compression.
"""

from __future__ import annotations

import math

import torch

SYMMETRIC = "symmetric"
ASYMMETRIC = "asymmetric"
_TINY = 1e-12  # smallest scale: an all-zero group quantizes to zeros instead of 0/0


def _grouped(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``x`` as ``(num_groups, -1)`` in fp32; ``num_groups`` must divide ``x.numel()``."""
    if num_groups < 1 or x.numel() % num_groups:
        raise ValueError(f"quantize_groups={num_groups} must divide the tensor's {x.numel()} elements "
                         f"(shape {tuple(x.shape)}); pick a divisor of the weight size")
    return x.detach().reshape(num_groups, -1).float()


def _round(x: torch.Tensor, stochastic: bool) -> torch.Tensor:
    # stochastic rounding: floor(x + U[0,1)) rounds up with probability frac(x), unbiased in expectation
    return torch.floor(x + torch.rand_like(x)) if stochastic else torch.round(x)


def quantize_symmetric(x: torch.Tensor, num_bits: int, num_groups: int = 1, stochastic: bool = False,
                       max_abs: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric ``num_bits`` grid per group: ``scale = 2 max|x| / 2**bits``, integers in
    ``[-2**(bits-1), 2**(bits-1) - 1]``. ``max_abs`` fixes the range (static activation ranges)."""
    flat = _grouped(x, num_groups)
    q_range = 2 ** num_bits
    if max_abs is None:
        max_abs = flat.abs().amax(dim=1, keepdim=True)
    scale = (2 * max_abs.float() / q_range).clamp_min(_TINY)
    q = _round(flat / scale, stochastic).clamp(-(q_range // 2), q_range // 2 - 1)
    return (q * scale).reshape(x.shape).to(x.dtype)


def quantize_asymmetric(x: torch.Tensor, num_bits: int, num_groups: int = 1, stochastic: bool = False,
                        min_max: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Asymmetric ``num_bits`` grid per group: ``scale = (max - min) / 2**bits``, a zero point on the grid, integers
    in ``[0, 2**bits - 1]``. ``min_max`` fixes the range (static activation ranges)."""
    flat = _grouped(x, num_groups)
    q_range = 2 ** num_bits
    if min_max is None:
        lo, hi = flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True)
    else:
        lo, hi = min_max[0].float(), min_max[1].float()
    scale = ((hi - lo) / q_range).clamp_min(_TINY)
    zero_point = torch.round(lo / scale) * scale
    q = _round((flat - zero_point) / scale, stochastic).clamp(0, q_range - 1)
    return (q * scale + zero_point).reshape(x.shape).to(x.dtype)


def quantize_ternary(x: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    """2-bit (ternary) weights ``{-a, 0, a}`` per group: threshold ``0.7 * mean|x|``, ``a`` = mean of the
    magnitudes above it (TWN)."""
    flat = _grouped(x, num_groups)
    thres = 0.7 * flat.abs().mean(dim=1, keepdim=True)
    keep = flat.abs() > thres
    alpha = (flat.abs() * keep).sum(dim=1, keepdim=True) / keep.sum(dim=1, keepdim=True).clamp_min(1)
    out = alpha * (flat > thres) - alpha * (flat < -thres)
    return out.reshape(x.shape).to(x.dtype)


def quantize_binary(x: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    """1-bit weights ``{-m, m}`` per group, ``m = mean|x|`` (zeros go to ``+m``: two values, never three)."""
    flat = _grouped(x, num_groups)
    m = flat.abs().mean(dim=1, keepdim=True)
    return torch.where(flat >= 0, m, -m).reshape(x.shape).to(x.dtype)


def quantize(x: torch.Tensor, num_bits: int, quantization_type: str = SYMMETRIC, num_groups: int = 1,
             rounding: str = "nearest") -> torch.Tensor:
    """Quantize-dequantize ``x`` to ``num_bits`` (>= 3: a uniform grid; 2: ternary; 1: binary, both symmetric
    only). At most ``2**num_bits`` distinct values per group."""
    if num_bits >= 3:
        fn = quantize_symmetric if quantization_type == SYMMETRIC else quantize_asymmetric
        return fn(x, num_bits, num_groups, stochastic=rounding == "stochastic")
    if num_bits < 1:
        raise ValueError(f"quantization bits must be >= 1, got {num_bits}")
    if quantization_type != SYMMETRIC:
        raise ValueError(f"{num_bits}-bit weight quantization is symmetric only (ternary/binary); got "
                         f"quantization_type={quantization_type!r}")
    return quantize_ternary(x, num_groups) if num_bits == 2 else quantize_binary(x, num_groups)


class _StraightThrough(torch.autograd.Function):
    """Base of the fake quantizers below (five inputs, the tensor first): backward passes the gradient through
    unchanged, as quantization-aware training does."""

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None


class _FakeQuant(_StraightThrough):
    """Straight-through wrapper around ``quantize``: forward quantizes, backward is the identity."""

    @staticmethod
    def forward(ctx, x, num_bits, quantization_type, num_groups, rounding):
        return quantize(x, num_bits, quantization_type, num_groups, rounding)


def fake_quantize(x: torch.Tensor, num_bits: int, quantization_type: str = SYMMETRIC, num_groups: int = 1,
                  rounding: str = "nearest") -> torch.Tensor:
    """``quantize`` with a straight-through gradient (quantization-aware training)."""
    return _FakeQuant.apply(x, num_bits, quantization_type, num_groups, rounding)


class SymQuantizer(_StraightThrough):
    """Symmetric fake quantization with a straight-through gradient. ``min_value``/``max_value`` fix the range
    (static activations, one group); otherwise each of ``num_groups`` groups uses its own ``max|x|``."""

    @staticmethod
    def forward(ctx, input, num_bits, min_value=None, max_value=None, num_groups=1):
        if min_value is None:
            return quantize_symmetric(input, num_bits, num_groups)
        return quantize_symmetric(input, num_bits, 1, max_abs=torch.maximum(min_value.abs(), max_value.abs()))


class AsymQuantizer(_StraightThrough):
    """Asymmetric fake quantization with a straight-through gradient (see ``SymQuantizer``)."""

    @staticmethod
    def forward(ctx, input, num_bits, min_value=None, max_value=None, num_groups=1):
        if min_value is None:
            return quantize_asymmetric(input, num_bits, num_groups)
        return quantize_asymmetric(input, num_bits, 1, min_max=(min_value, max_value))


class TernaryQuantizer(_StraightThrough):
    """2-bit (ternary) fake quantization with a straight-through gradient; ``num_bits`` is ignored."""

    @staticmethod
    def forward(ctx, input, num_bits=2, min_value=None, max_value=None, num_groups=1):
        return quantize_ternary(input, num_groups)


class BinaryQuantizer(_StraightThrough):
    """1-bit (binary) fake quantization with a straight-through gradient; ``num_bits`` is ignored."""

    @staticmethod
    def forward(ctx, input, num_bits=1, min_value=None, max_value=None, num_groups=1):
        return quantize_binary(input, num_groups)


def topk_mask(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """1 for the ``ceil(ratio * numel)`` largest entries of ``scores``, 0 elsewhere (ties: the first in order)."""
    keep = math.ceil(ratio * scores.numel())
    mask = torch.zeros(scores.numel(), dtype=scores.dtype, device=scores.device)
    mask[torch.topk(scores.detach().flatten().float(), keep, sorted=False).indices] = 1
    return mask.view_as(scores)


class TopKBinarizer(torch.autograd.Function):
    """Binary mask of the ``threshold`` fraction of highest ``inputs`` (the kept share; ``sigmoid``: the
    threshold is a logit). The gradient passes straight through to the scores, so they learn what to keep."""

    @staticmethod
    def forward(ctx, inputs, threshold, sigmoid=False):
        ctx.sigmoid = sigmoid
        if sigmoid:
            threshold = torch.sigmoid(threshold).item()
        mask = topk_mask(inputs, float(threshold))
        ctx.save_for_backward(mask)
        return mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        if ctx.sigmoid:
            return grad.clone(), (grad * mask).sum().view(-1), None
        return grad.clone(), None, None


class QuantAct(torch.nn.Module):
    """Static activation quantization: one range for all tokens/images, tracked with momentum
    ``act_range_momentum`` in training and fixed in eval (fast inference, some accuracy cost)."""

    def __init__(self, act_range_momentum: float = 0.95, quant_mode: str = SYMMETRIC) -> None:
        super().__init__()
        self.act_range_momentum = act_range_momentum
        self.quant_mode = quant_mode
        self.register_buffer("x_min_max", torch.zeros(2))

    @torch.no_grad()
    def _track(self, x: torch.Tensor) -> None:
        lo, hi = x.detach().min().float(), x.detach().max().float()
        if self.x_min_max[0] == self.x_min_max[1]:  # first batch: start from its range
            self.x_min_max[0], self.x_min_max[1] = lo, hi
        m = self.act_range_momentum
        self.x_min_max[0] = self.x_min_max[0] * m + lo * (1 - m)
        self.x_min_max[1] = self.x_min_max[1] * m + hi * (1 - m)

    def forward(self, x: torch.Tensor, num_bits: int, *args: object) -> torch.Tensor:
        # an uncalibrated range would quantize everything to 0: calibrate on the first batch even in eval
        if self.training or self.x_min_max[0] == self.x_min_max[1]:
            self._track(x)
        lo, hi = self.x_min_max[0], self.x_min_max[1]
        if self.quant_mode == SYMMETRIC:
            q = quantize_symmetric(x, num_bits, 1, max_abs=torch.maximum(lo.abs(), hi.abs()))
        else:
            q = quantize_asymmetric(x, num_bits, 1, min_max=(lo, hi))
        return x + (q - x).detach()  # straight-through gradient
