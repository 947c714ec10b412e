"""``zero_quantized_nontrainable_weights``: the partitions of parameters that do not train (frozen base weights
under LoRA) are stored int8-quantized, blockwise, instead of in the training dtype (1 byte per element plus one
fp32 scale per block instead of 2 or 4 bytes), and gathered as they are stored (no quantization on the way).

A stored-quantized parameter's ``ds_tensor`` holds the int8 codes (so its ``numel()`` is still the partition
size every layout computation uses) and ``ds_scales`` the scales; :func:`partition_values` reads the partition
back as values (checkpoints save those) and :func:`set_partition_values` writes new values (checkpoint load,
``GatheredParameters(modifier_rank=...)``). The values of such a parameter are its dequantized codes from then
on: quantizing is done once, when the model is partitioned.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ds_zero.zeropp.quant import Quantized, dequantize, pack, quantize


def is_stored_quantized(param: torch.nn.Parameter) -> bool:
    return getattr(param, "ds_scales", None) is not None


def _store(param: torch.nn.Parameter, values: torch.Tensor, block: int) -> None:
    part = param.ds_tensor.numel()
    q = quantize(values.reshape(-1), block)
    codes = q.codes.to(param.ds_tensor.device)
    codes.ds_numel = part
    param.ds_tensor = codes
    param.ds_scales = q.scales.to(codes.device)
    param.ds_quant_block = block


def quantize_nontrainable(params: Iterable[torch.nn.Parameter], block: int) -> int:
    """Store the partition of every partitioned, floating-point parameter that does not require a gradient
    quantized; returns how many were converted."""
    count = 0
    for p in params:
        if hasattr(p, "ds_id") and not p.requires_grad and p.is_floating_point() and not is_stored_quantized(p) \
                and getattr(p, "ds_swapper", None) is None:  # partitions on NVMe keep their dtype
            _store(p, p.ds_tensor, block)
            count += 1
    return count


def partition_values(param: torch.nn.Parameter, dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's partition of ``param`` as values (dequantized when stored quantized)."""
    if not is_stored_quantized(param):
        return param.ds_tensor
    return dequantize(stored(param), dtype or param.dtype)


def set_partition_values(param: torch.nn.Parameter, values: torch.Tensor) -> None:
    """Make ``values`` (the partition's size) this rank's partition, quantized again when stored quantized."""
    if is_stored_quantized(param):
        _store(param, values, param.ds_quant_block)
    else:
        with torch.no_grad():
            param.ds_tensor.copy_(values.reshape(-1))


def stored(param: torch.nn.Parameter) -> Quantized:
    """The stored codes and scales of a stored-quantized parameter."""
    return Quantized(param.ds_tensor, param.ds_scales, param.ds_tensor.numel(), param.ds_quant_block)


def packed(param: torch.nn.Parameter) -> torch.Tensor:
    """The wire form (``quant.pack``) of a stored-quantized partition."""
    return pack(stored(param))


def write_full(param: torch.nn.Parameter, full: torch.Tensor) -> None:
    """This rank's slice of ``full`` (the whole value, ``ds_numel`` elements) becomes its partition, stored the
    way the parameter stores it."""
    from ds_zero.zero3.param import write_partition_from_full

    if not is_stored_quantized(param):
        write_partition_from_full(param, full.to(param.ds_tensor.dtype))
        return
    part, rank = param.ds_tensor.numel(), param.ds_space.rank
    flat = full.reshape(-1)
    start = min(rank * part, flat.numel())
    end = min(start + part, flat.numel())
    values = torch.zeros(part, dtype=torch.float32, device=param.ds_tensor.device)
    values[:end - start].copy_(flat[start:end])
    set_partition_values(param, values)
