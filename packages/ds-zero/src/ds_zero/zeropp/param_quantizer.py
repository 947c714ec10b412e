"""ZeRO++'s parameter quantizer under DeepSpeed's name, ``CUDAQuantizer`` (``partition_parameters``' import path).

DeepSpeed's class wraps its compiled quantizer op (``QuantizerBuilder``): symmetric int8, ``groups`` equal
contiguous groups per tensor, one scale each, fp16 in and fp16 out. Here the op is :class:`QuantizerOp`, the same
call signature on this package's blockwise quantizer (:mod:`ds_zero.zeropp.quant`; plain torch, any device), so
code written against DeepSpeed's class (``quantize(param) -> (int8, scales)``, ``dequantize(q, scales, dtype)``,
a replaced ``quantizer_cuda_module``) runs unchanged. The ZeRO++ collectives of this package quantize through
``quant`` directly; this class is the public entry point for callers that quantize parameters themselves.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ds_zero.zeropp import quant

_MAX_GROUP = 16000  # the kernel's hard limit on elements per group
_VECTOR = 8  # the kernel reads 8 elements at a time: every group's size is a multiple of 8


class QuantizerOp:
    """The quantizer op's interface (``quantize``/``dequantize`` with ``groups``, ``num_bits``, ``quant_type``)
    on :mod:`ds_zero.zeropp.quant`. Only what ZeRO++ uses is built: 8 bits, symmetric."""

    Symmetric = 0
    Asymmetric = 1

    @staticmethod
    def _check(num_bits: int, quant_type: int) -> None:
        if num_bits != 8:
            raise ValueError(f"QuantizerOp: num_bits={num_bits!r} is not supported; ZeRO++ weights use 8")
        if quant_type != QuantizerOp.Symmetric:
            raise ValueError(f"QuantizerOp: quant_type={quant_type!r} is not supported; only Symmetric "
                             f"({QuantizerOp.Symmetric}) is built")

    def quantize(self, param: torch.Tensor, groups: int, num_bits: int = 8,
                 quant_type: int = Symmetric) -> tuple[torch.Tensor, torch.Tensor]:
        """``param`` (read flat) as int8 codes of shape ``(groups, numel // groups)`` and fp32 scales
        ``(groups, 1)``; values are ``codes * scale``."""
        self._check(num_bits, quant_type)
        numel = param.numel()
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or numel % groups:
            raise ValueError(f"QuantizerOp.quantize: groups={groups!r} must be a positive divisor of the tensor's "
                             f"{numel} elements")
        q = quant.quantize(param, block=numel // groups)
        return q.codes.view(groups, -1), q.scales.view(groups, 1)

    def dequantize(self, quantized: torch.Tensor, scale: torch.Tensor, num_groups: int, num_bits: int = 8,
                   quant_type: int = Symmetric) -> torch.Tensor:
        """The fp16 values of ``quantized`` (``num_groups`` groups, one scale each), shaped as ``quantized``."""
        self._check(num_bits, quant_type)
        numel = quantized.numel()
        if scale.numel() != num_groups or num_groups < 1 or numel % num_groups:
            raise ValueError(f"QuantizerOp.dequantize: {scale.numel()} scales for num_groups={num_groups!r} over "
                             f"{numel} codes; expected one scale per group and equal groups")
        q = quant.Quantized(quantized.reshape(-1), scale.reshape(-1).float(), numel, numel // num_groups)
        return quant.dequantize(q, torch.float16).view(quantized.shape)


class CUDAQuantizer:
    """Quantize a ZeRO-3 parameter to int8 for a qwZ gather and back (DeepSpeed's class and attributes).

    The number of groups is chosen per tensor size (cached in ``group_size_cache``): groups of at most
    ``target_group_size``-ish elements, each a multiple of 8, below 16000. Values travel as fp16 (the op reads and
    writes fp16), so ``dequantize(..., dtype=param.dtype)`` hands a bf16/fp32 parameter back in its own dtype.
    """

    async_flag: ClassVar[bool] = True
    target_group_size: ClassVar[int] = 8000
    group_size_cache: ClassVar[dict[int, int]] = {}
    quantizer_cuda_module: ClassVar[Any] = None

    def __init__(self) -> None:
        if CUDAQuantizer.quantizer_cuda_module is None:
            CUDAQuantizer.quantizer_cuda_module = QuantizerOp()

    def groups_for(self, numel: int) -> int:
        """The group count for a tensor of ``numel`` elements (cached)."""
        cached = self.group_size_cache.get(numel)
        if cached is not None:
            return cached
        if numel <= 0 or numel % _VECTOR:
            raise ValueError(f"CUDAQuantizer: a quantized tensor needs a positive multiple of {_VECTOR} elements, "
                             f"got {numel}")
        groups = max(1, math.ceil(numel / self.target_group_size))
        while numel % (_VECTOR * groups):  # the smallest count >= the target whose groups are whole vectors
            groups += 1
        # halve the groups' size while they stay above the target and whole vectors
        while numel % (_VECTOR * groups * 2) == 0 and numel / groups > self.target_group_size:
            groups *= 2
        if numel / groups >= _MAX_GROUP:
            raise ValueError(f"CUDAQuantizer: no group size below {_MAX_GROUP} divides {numel} elements into "
                             f"multiples of {_VECTOR} (best: {groups} groups of {numel // groups})")
        self.group_size_cache[numel] = groups
        return groups

    def quantize(self, param: torch.Tensor, groups: int | None = None) -> Any:
        """``(int8 codes, scales)`` of ``param`` (converted to fp16 first, as the op reads fp16)."""
        if groups is None:
            groups = self.groups_for(param.numel())
        op = self.quantizer_cuda_module
        return op.quantize(param.to(dtype=torch.half), groups, 8, op.Symmetric)

    def dequantize(self, quantized_param: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values of ``quantized_param`` (fp16 from the op; in ``dtype`` when given)."""
        op = self.quantizer_cuda_module
        values = op.dequantize(quantized_param, scale, scale.numel(), 8, op.Symmetric)
        return values if dtype is None or values.dtype == dtype else values.to(dtype)


__all__ = ["CUDAQuantizer", "QuantizerOp"]
