"""Blockwise symmetric int8 quantization in plain torch, for the ZeRO++ collectives (qwZ weights, qgZ gradients).

A flat tensor is cut into blocks of ``block`` elements (the last one zero-padded); each block gets one fp32
scale ``max|x| / 127`` and its values become ``round(x / scale)`` in ``[-127, 127]``. Dequantized values are
within ``scale / 2`` of the originals (half a quantization step), so a block's error is at most
``max|block| / 254``. On the wire a quantized tensor is one ``uint8`` buffer: the int8 codes followed by the
scales' bytes, so a single exchange carries both (about ``1 + 4 / block`` bytes per element instead of 4 for
fp32 or 2 for 16-bit values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEFAULT_BLOCK = 256  # elements per scale: 1.6% overhead of the int8 payload, small error per block
_LEVELS = 127.0


def _check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"quantization block must be a positive integer (elements per scale), got {block!r}")


def blocks_of(numel: int, block: int) -> int:
    """Number of blocks (= scales) of a tensor of ``numel`` elements."""
    return math.ceil(numel / block) if numel else 0


def wire_bytes(numel: int, block: int = DEFAULT_BLOCK) -> int:
    """Bytes of the packed ``uint8`` form of ``numel`` elements: the codes and one fp32 scale per block."""
    return numel + 4 * blocks_of(numel, block)


@dataclass
class Quantized:
    """int8 ``codes`` (``numel`` of them) and one fp32 ``scale`` per block of ``block`` elements."""

    codes: torch.Tensor
    scales: torch.Tensor
    numel: int
    block: int


def quantize(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> Quantized:
    """Quantize ``x`` (any shape, floating point; read flat) blockwise to int8."""
    _check_block(block)
    if not x.is_floating_point():
        raise TypeError(f"quantize: expected a floating-point tensor, got {x.dtype}")
    flat = x.detach().reshape(-1).float()
    numel = flat.numel()
    nblocks = blocks_of(numel, block)
    padded = torch.nn.functional.pad(flat, (0, nblocks * block - numel)).view(nblocks, block)
    amax = padded.abs().amax(dim=1)
    scales = amax / _LEVELS
    # an all-zero block keeps scale 0 (it dequantizes to zeros); divide by 1 there instead of 0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded / safe.unsqueeze(1)).clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    return Quantized(codes.reshape(-1)[:numel], scales, numel, block)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The flat values of ``q`` in ``dtype``."""
    nblocks = q.scales.numel()
    codes = torch.nn.functional.pad(q.codes.float(), (0, nblocks * q.block - q.numel)).view(nblocks, q.block)
    return (codes * q.scales.unsqueeze(1)).reshape(-1)[:q.numel].to(dtype)


def pack(q: Quantized, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` as one ``uint8`` buffer of :func:`wire_bytes` bytes (codes, then the scales' bytes)."""
    size = wire_bytes(q.numel, q.block)
    buf = out if out is not None else torch.empty(size, dtype=torch.uint8, device=q.codes.device)
    if buf.numel() != size or buf.dtype != torch.uint8:
        raise ValueError(f"pack: the output must be a uint8 tensor of {size} bytes, got {buf.dtype} x {buf.numel()}")
    buf[:q.numel].copy_(q.codes.view(torch.uint8))
    buf[q.numel:].copy_(q.scales.float().contiguous().view(torch.uint8))
    return buf


def unpack(buf: torch.Tensor, numel: int, block: int = DEFAULT_BLOCK) -> Quantized:
    """The :class:`Quantized` of ``numel`` elements held by the ``uint8`` buffer ``buf`` (see :func:`pack`)."""
    _check_block(block)
    size = wire_bytes(numel, block)
    if buf.numel() != size:
        raise ValueError(f"unpack: {numel} elements in blocks of {block} take {size} bytes, the buffer has "
                         f"{buf.numel()}")
    codes = buf[:numel].view(torch.int8)
    scales = buf[numel:].clone().view(torch.float32)  # clone: the scales' bytes may not be 4-byte aligned
    return Quantized(codes, scales, numel, block)


def quantize_packed(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """``pack(quantize(x, block))``: the wire form of ``x``."""
    return pack(quantize(x, block))


def dequantize_packed(buf: torch.Tensor, numel: int, block: int = DEFAULT_BLOCK,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of a packed buffer (``numel`` elements), in ``dtype``."""
    return dequantize(unpack(buf, numel, block), dtype)
