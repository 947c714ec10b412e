"""Asymmetric group-wise INT4/INT8 quantization of tensors, and the packed parameter format of quantized layers.

A tensor is cut along ``group_dim`` into groups of ``group_size`` values; each group keeps its minimum ``m`` and
scale ``s = (2**bits - 1) / (max - m)``; codes are ``round((x - m) * s)`` in ``[0, 2**bits - 1]`` and
``x ~= code / s + m``. INT4 codes are packed two per byte along the last dimension (first value in the high
nibble). The math runs in fp32 whatever the tensor's dtype (CPU has no fp16 rounding), scale and minimum are
returned in the tensor's dtype. A group whose values are all equal gets scale 1 (exact), not a division by zero.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

_KEYS = ("num_bits", "group_size", "group_dim", "symmetric")


def _checked(config: dict) -> dict:
    missing = [k for k in _KEYS if k not in config]
    if missing:
        raise ValueError(f"quantization config {config}: missing keys {missing} (needs {list(_KEYS)})")
    if config["num_bits"] not in (4, 8):
        raise ValueError(f"quantization config num_bits={config['num_bits']!r}: accepted 4 or 8")
    if config["symmetric"]:
        raise ValueError("quantization config symmetric=True: only asymmetric quantization (symmetric: false) "
                         "is supported")
    if not isinstance(config["group_size"], int) or config["group_size"] < 1:
        raise ValueError(f"quantization config group_size={config['group_size']!r}: must be an int >= 1")
    return config


def _grouped_shape(shape: torch.Size, config: dict) -> tuple[int, ...]:
    dim, size = config["group_dim"], config["group_size"]
    if not -len(shape) <= dim < len(shape) or shape[dim] % size:
        raise ValueError(f"cannot quantize a tensor of shape {tuple(shape)} in groups of group_size={size} along "
                         f"group_dim={dim}: that dimension must exist and be a multiple of group_size")
    dim %= len(shape)
    return (*shape[:dim], shape[dim] // size, size, *shape[dim + 1:])


class Quantizer:
    """``Quantizer(config).quantize(tensor) -> (codes uint8, scale, min)``; config keys num_bits (4 or 8),
    group_size, group_dim, symmetric (False)."""

    def __init__(self, config: dict) -> None:
        self.config = _checked(config)

    def quantize(self, tensor: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        grouped = tensor.detach().float().reshape(_grouped_shape(tensor.shape, self.config))
        axis = self.config["group_dim"] % tensor.dim() + 1
        q_range = 2 ** self.config["num_bits"] - 1
        low = grouped.amin(dim=axis, keepdim=True)
        span = grouped.amax(dim=axis, keepdim=True) - low
        scale = torch.where(span > 0, q_range / span, torch.ones_like(span))
        codes = ((grouped - low) * scale).round_().clamp_(0, q_range).to(torch.uint8).view(tensor.shape)
        if self.config["num_bits"] == 4:
            codes = self._compress_uint8_to_uint4(codes)
        return codes, scale.to(tensor.dtype), low.to(tensor.dtype)

    @staticmethod
    def _compress_uint8_to_uint4(codes: Tensor) -> Tensor:
        if codes.shape[-1] % 2:
            raise ValueError(f"INT4 packing needs an even last dimension; got shape {tuple(codes.shape)}")
        return codes[..., 0::2].bitwise_left_shift(4).bitwise_or_(codes[..., 1::2])


class DeQuantizer:
    """``DeQuantizer(config, dtype).dequantize(codes, scale, min)``: the tensor back in ``dtype``."""

    def __init__(self, config: dict, dtype: torch.dtype) -> None:
        self.config = _checked(config)
        self.dtype = dtype

    def dequantize(self, tensor: Tensor, quant_scale: Tensor, quant_min: Tensor) -> Tensor:
        codes = self._decompress_uint4_to_uint8(tensor) if self.config["num_bits"] == 4 else tensor
        grouped = codes.float().reshape(_grouped_shape(codes.shape, self.config))
        values = grouped / quant_scale.float() + quant_min.float()
        return values.view(codes.shape).to(self.dtype)

    @staticmethod
    def _decompress_uint4_to_uint8(tensor: Tensor) -> Tensor:
        out = torch.empty((*tensor.shape[:-1], tensor.shape[-1] * 2), dtype=torch.uint8, device=tensor.device)
        out[..., 0::2] = tensor.bitwise_right_shift(4)
        out[..., 1::2] = tensor.bitwise_and(0xF)
        return out


def concat_to_compat_param(quantized_weight: Tensor, quant_scale: Tensor, quant_min: Tensor,
                           return_param: bool = True) -> nn.Parameter | Tensor:
    """One flat tensor holding codes (viewed in the scale's dtype, padded to whole elements), scales and minima,
    with ``.deconcat(t) -> (codes, scale, min)`` to take it apart (the layout of DeepSpeed's quantized layers)."""
    dtype = quant_scale.dtype
    codes = quantized_weight.reshape(-1)
    if codes.dtype == torch.uint8:
        width = torch.empty((), dtype=dtype).element_size()
        codes = torch.nn.functional.pad(codes, (0, -codes.numel() % width)).view(dtype)
    pieces = [codes, quant_scale.reshape(-1), quant_min.reshape(-1).to(dtype)]
    compat = torch.cat(pieces)
    if return_param:
        compat = nn.Parameter(compat, requires_grad=False)
    sizes = [p.numel() for p in pieces]
    shapes = (quantized_weight.shape, quantized_weight.dtype, quant_scale.shape, quant_min.shape)

    def deconcat(flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        weight_shape, weight_dtype, scale_shape, min_shape = shapes
        codes, scale, low = torch.split(flat.detach(), sizes)
        if weight_dtype == torch.uint8:
            codes = codes.view(torch.uint8)[:weight_shape.numel()]
        return codes.reshape(weight_shape), scale.view(scale_shape), low.view(min_shape)

    compat.deconcat = deconcat
    return compat


def _quantize_param(param: nn.Parameter, quant_config: dict) -> None:
    """Replace ``param``'s data by its packed quantized form in place (``weight_quantized`` marks it)."""
    if getattr(param, "weight_quantized", False):
        raise ValueError(f"_quantize_param: the parameter (packed shape {tuple(param.shape)}) is already quantized "
                         "(weight_quantized is set); each parameter is quantized once")
    quantizer = Quantizer(quant_config)
    codes, scale, low = quantizer.quantize(param.data)
    compat = concat_to_compat_param(codes, scale, low, return_param=False)
    param.data = compat
    param.deconcat = compat.deconcat
    param.quantizer = quantizer
    param.dequantizer = DeQuantizer(quant_config, scale.dtype)
    param.weight_quantized = True


def dequantized_weight(weight: Tensor) -> Tensor:
    """The float weight of a packed quantized parameter."""
    codes, scale, low = weight.deconcat(weight)
    return weight.dequantizer.dequantize(codes, scale, low)


def wrap_quantized_functional(f: Callable) -> Callable:
    """``f(input, weight, ...)`` that dequantizes ``weight`` first when it is a quantized parameter."""

    @functools.wraps(f)
    def wrapper(input: Tensor, weight: Tensor, *args, **kwargs):  # noqa: A002 - torch's name
        if getattr(weight, "weight_quantized", False):
            weight = dequantized_weight(weight)
        return f(input, weight, *args, **kwargs)

    return wrapper


def wrap_load_from_state_dict(f: Callable) -> Callable:
    """A ``_load_from_state_dict`` that quantizes an incoming float ``weight`` for a module whose weight is
    quantized (the state dict itself is left as it was)."""

    @functools.wraps(f)
    def wrapper(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        weight, key = getattr(module, "weight", None), prefix + "weight"
        if not getattr(weight, "weight_quantized", False) or key not in state_dict \
                or getattr(weight, "state_dict_quantized", False):
            return f(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        original = state_dict[key]
        weight.state_dict_quantized = True  # nested wrappers quantize once
        try:
            codes, scale, low = weight.quantizer.quantize(original)
            packed = concat_to_compat_param(codes, scale, low, return_param=False)
            state_dict[key] = packed
            f(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
            weight.deconcat = packed.deconcat
        finally:
            state_dict[key] = original
            del weight.state_dict_quantized

    return wrapper


def recursive_setattr(model: nn.Module, module_name: str, module: nn.Module) -> None:
    """``model.<a>.<b>.<c> = module`` for ``module_name = "a.b.c"``."""
    *parents, last = module_name.split(".")
    owner = model
    for name in parents:
        owner = getattr(owner, name)
    setattr(owner, last, module)


WEIGHT_QUANTIZATION_LAYERS = (nn.Linear, nn.Embedding)
