"""FP8 storage of frozen weights: ``QuantizedParameter`` and ``QuantizedLinear`` (``deepspeed.linear``).

Group-wise absmax quantization in torch: each ``group_size`` consecutive values share one fp32 scale
(``absmax / fp8_max``) and are stored as FP8 codes (e4m3 or e5m2, ``QuantizationConfig``). The parameter's data
is one uint8 buffer, codes first, then the scales' bytes, so moving it between devices (``module.to``) moves
both; ``dequantized()`` rebuilds the weight in its original shape and dtype. DeepSpeed does this with a CUDA
kernel and only on the accelerator; here it runs on any device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepspeed.linear.config import QuantizationConfig


def quantize(values: torch.Tensor, config: QuantizationConfig) -> torch.Tensor:
    """``values`` -> the packed uint8 buffer (codes, then one fp32 scale per group)."""
    flat = values.detach().reshape(-1).float()
    groups = max(1, -(-flat.numel() // config.group_size))
    padded = F.pad(flat, (0, groups * config.group_size - flat.numel())).view(groups, config.group_size)
    absmax = padded.abs().amax(dim=1, keepdim=True)
    scales = torch.where(absmax > 0, absmax / torch.finfo(config.fp8_dtype).max, torch.ones_like(absmax))
    codes = (padded / scales).to(config.fp8_dtype).view(torch.uint8).reshape(-1)
    return torch.cat([codes, scales.reshape(-1).view(torch.uint8)])


def dequantize(packed: torch.Tensor, config: QuantizationConfig, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    numel = shape.numel()
    groups = max(1, -(-numel // config.group_size))
    codes = packed[:groups * config.group_size].view(config.fp8_dtype).float().view(groups, config.group_size)
    scales = packed[groups * config.group_size:].view(torch.float32).view(groups, 1)
    return (codes * scales).reshape(-1)[:numel].view(shape).to(dtype)


class QuantizedParameter(nn.Parameter):
    """A frozen parameter held as FP8 codes plus scales; ``dequantized()`` is the weight (original shape/dtype).

    ``requires_grad=True`` is refused: quantized weights are frozen.
    """

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = False,
                quantization_config: QuantizationConfig | None = None):
        if requires_grad:
            raise ValueError("QuantizedParameter(requires_grad=True): quantized weights are frozen")
        data = torch.empty(0) if data is None else data
        config = QuantizationConfig() if quantization_config is None else quantization_config
        self = torch.Tensor._make_subclass(cls, quantize(data, config), False)
        self.quantization_config = config
        self.orig_shape, self.orig_dtype = data.shape, data.dtype
        return self

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.data, self.quantization_config, self.orig_shape, self.orig_dtype)

    def __deepcopy__(self, memo):
        copy = torch.Tensor._make_subclass(type(self), self.data.clone(), False)
        copy.quantization_config, copy.orig_shape, copy.orig_dtype = (
            self.quantization_config, self.orig_shape, self.orig_dtype)
        memo[id(self)] = copy
        return copy

    def __reduce_ex__(self, protocol):
        return (_rebuild, (self.data, self.quantization_config, self.orig_shape, self.orig_dtype))


def _rebuild(packed, config, shape, dtype) -> QuantizedParameter:
    param = torch.Tensor._make_subclass(QuantizedParameter, packed, False)
    param.quantization_config, param.orig_shape, param.orig_dtype = config, shape, dtype
    return param


class QuantizedLinear(nn.Linear):
    """``nn.Linear`` whose weight is a :class:`QuantizedParameter`, dequantized for each forward (bf16 only)."""

    def __init__(self, input_dim: int, output_dim: int, bias: bool = False,
                 quantization_config: QuantizationConfig | None = None, dtype=torch.bfloat16):
        if dtype != torch.bfloat16:
            raise ValueError(f"QuantizedLinear: dtype must be torch.bfloat16, got {dtype}")
        super().__init__(input_dim, output_dim, bias=bias, dtype=dtype)
        self.weight = QuantizedParameter(self.weight.data, quantization_config=quantization_config)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        return F.linear(input, self.weight.dequantized(), self.bias)
