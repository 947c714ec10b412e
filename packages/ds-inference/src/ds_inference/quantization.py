"""Weight-only integer quantization of Linear weights, dequantized on the fly (``dtype=torch.int8`` / ``quant``).

A weight matrix is flattened and cut into ``q_groups`` equal groups; each group gets its own scale (and, for
``q_type="asymmetric"``, its own zero point). Values are stored as ``int8`` whatever ``num_bits`` (<= 8) is, so
memory is 1 byte per weight element plus 4 bytes per group. The module keeps its class and its ``forward``:
a pre-forward hook rebuilds ``module.weight`` in the activation dtype just before the module runs and a
forward hook drops it afterwards, so the float weight only exists while its own layer runs. That works for
``nn.Linear``, Hugging Face's ``Conv1D`` (GPT-2) and tensor-parallel Linear replacements alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "QuantizedWeight",
    "dequantize",
    "is_quantized",
    "model_bytes",
    "quantize",
    "quantize_linear_weights",
]


@dataclass
class QuantizedWeight:
    """Integer codes and per-group parameters of one weight: ``w ~= (q - zero) * scale`` group by group."""

    q: torch.Tensor  # int8, the weight's shape
    scale: torch.Tensor  # float32 [groups, 1]
    zero: torch.Tensor | None  # float32 [groups, 1] for asymmetric, None for symmetric


def _grouped(weight: torch.Tensor, groups: int) -> torch.Tensor:
    if groups < 1 or weight.numel() % groups:
        raise ValueError(f"quant.weight.q_groups={groups} must divide the weight's {weight.numel()} elements "
                         f"(shape {tuple(weight.shape)}); pick a divisor such as 1 or the row count")
    return weight.detach().float().reshape(groups, -1)


def quantize(weight: torch.Tensor, num_bits: int = 8, groups: int = 1, q_type: str = "symmetric") -> QuantizedWeight:
    """Quantize ``weight`` to ``num_bits`` (2..8) with ``groups`` scales.

    Symmetric: ``scale = max|w| / (2**(bits-1) - 1)``, codes in ``[-(2**(bits-1) - 1), 2**(bits-1) - 1]``;
    the rounding error is at most ``scale / 2`` per element. Asymmetric: ``scale = (max - min) / (2**bits - 1)``
    and a per-group zero point, codes in ``[-2**(bits-1), 2**(bits-1) - 1]``.
    """
    if not 2 <= num_bits <= 8:
        raise ValueError(f"quant.weight.num_bits={num_bits} is not supported; accepted: 2..8 (stored as int8)")
    flat = _grouped(weight, groups)
    if q_type == "symmetric":
        qmax = 2 ** (num_bits - 1) - 1
        scale = flat.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / qmax
        q = torch.round(flat / scale).clamp_(-qmax, qmax)
        zero = None
    elif q_type == "asymmetric":
        low, high = flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True)
        scale = ((high - low) / (2**num_bits - 1)).clamp_min(torch.finfo(torch.float32).tiny)
        zero = -(2 ** (num_bits - 1)) - torch.round(low / scale)
        q = torch.round(flat / scale + zero).clamp_(-(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1)
    else:
        raise ValueError(f"quant.weight.q_type={q_type!r} is not supported; accepted: 'symmetric', 'asymmetric'")
    return QuantizedWeight(q.to(torch.int8).reshape(weight.shape), scale, zero)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``qw`` stands for, in ``dtype``."""
    groups = qw.scale.shape[0]
    codes = qw.q.reshape(groups, -1).to(qw.scale.dtype)
    if qw.zero is not None:
        codes = codes - qw.zero
    return (codes * qw.scale).reshape(qw.q.shape).to(dtype)


def is_quantized(module: nn.Module) -> bool:
    """Whether :func:`quantize_linear_weights` replaced this module's weight by int8 codes."""
    return "weight_q" in module._buffers


def _is_linear_like(module: nn.Module) -> bool:
    """nn.Linear (and subclasses, e.g. tensor-parallel replacements) and transformers' Conv1D (GPT-2)."""
    weight = module._parameters.get("weight")
    if weight is None or weight.dim() != 2 or not weight.is_floating_point():
        return False
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of weight tensors reachable from two modules (tied lm_head / embedding): those stay in float."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _dequantize_hook(module: nn.Module, args: tuple) -> None:
    dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()),
                 module.weight_scale.dtype)
    # a plain attribute, not a Parameter: the layer's own forward reads ``self.weight`` as usual
    module.weight = dequantize(QuantizedWeight(module.weight_q, module.weight_scale, module._buffers.get(
        "weight_zero")), dtype)


def _drop_hook(module: nn.Module, args: tuple, output: object) -> None:
    module.__dict__.pop("weight", None)


def _quantize_module(module: nn.Module, num_bits: int, groups: int, q_type: str) -> None:
    qw = quantize(module.weight, num_bits, groups, q_type)
    del module._parameters["weight"]
    module.register_buffer("weight_q", qw.q)
    module.register_buffer("weight_scale", qw.scale)
    if qw.zero is not None:
        module.register_buffer("weight_zero", qw.zero)
    module.register_forward_pre_hook(_dequantize_hook)
    module.register_forward_hook(_drop_hook)


def quantize_linear_weights(model: nn.Module, num_bits: int = 8, groups: int = 1,
                            q_type: str = "symmetric") -> list[str]:
    """Quantize, in place, the weight of every Linear-like module whose weight is not tied to another module.

    Returns the names of the quantized modules. Biases, norms and embeddings stay in their float dtype.
    """
    tied = _shared_weights(model)
    names = []
    for name, module in model.named_modules():
        if _is_linear_like(module) and id(module.weight) not in tied and not is_quantized(module):
            _quantize_module(module, num_bits, groups, q_type)
            names.append(name)
    return names


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds (accounting; a tied tensor counts once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total
