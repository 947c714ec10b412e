"""1-bit compressed all-reduce with worker and server error feedback (1-bit Adam's communication).

Each rank adds its ``worker_error`` to the tensor, keeps the sign of every element (1 bit on the wire, packed
8 per uint8) and one fp32 scale per block of ``block`` elements (the block's RMS, as DeepSpeed, so sign *
scale keeps the block's L2 norm); what the compression lost becomes the new ``worker_error``. The padded
tensor is cut into one chunk per rank: an ``all_to_all`` sends chunk r's signs and scales to rank r (the
"server" of that chunk), which averages the decompressed chunks of every rank, adds its ``server_error``,
compresses the average the same way and ``all_gather``s it back. Everyone ends with the same averaged
tensor. Wire bytes per rank: ``n/8`` (signs out) + ``n/(8 world)`` (server signs) + ``4 n/block`` (scales),
against ``4 n`` for an fp32 all-reduce. ``reference_compressed_allreduce`` does the same arithmetic in one
process over a list of the ranks' tensors; the tests check the two agree. Collectives go through
``deepspeed.comm`` (comms logger).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

BLOCK = 2048  # elements per scale: 4 bytes per 2048 elements adds 1/64 bit per element on the wire

_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def pack_signs(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor (numel a multiple of 8) into uint8, most significant bit first (``numpy.packbits``)."""
    if bits.numel() % 8:
        raise ValueError(f"pack_signs: {bits.numel()} bits is not a multiple of 8")
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=bits.device)
    return (bits.reshape(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_signs``: uint8 -> bool tensor of 8 bits per byte."""
    shifts = _SHIFTS.to(packed.device)
    return ((packed.reshape(-1, 1) >> shifts) & 1).reshape(-1).bool()


def block_size(numel: int, world: int, block: int = BLOCK) -> int:
    """The block used for a ``numel``-element tensor: ``block``, smaller for small tensors (a multiple of 8)."""
    per_rank = math.ceil(numel / world)
    return max(8, min(block, math.ceil(per_rank / 8) * 8))


def error_sizes(numel: int, world: int, block: int = BLOCK) -> tuple[int, int]:
    """(worker_error numel, server_error numel) for a ``numel``-element tensor over ``world`` ranks."""
    b = block_size(numel, world, block)
    padded = math.ceil(numel / (world * b)) * world * b
    return padded, padded // world


def _compress(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sign bits, per-block scales, x - decompressed) of a flat tensor whose numel is a multiple of ``block``."""
    blocks = x.view(-1, block)
    scales = torch.linalg.vector_norm(blocks, dim=1) / math.sqrt(block)
    bits = blocks >= 0  # sign(0) counts as +1, as DeepSpeed's sign().add_(1).bool()
    error = (blocks - scales[:, None] * (bits.to(x.dtype) * 2 - 1)).view(-1)
    return bits.view(-1), scales, error


def _decompress(bits: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    return ((bits.view(-1, block).float() * 2 - 1) * scales.view(-1, 1).float()).view(-1)


def _check(buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, world: int,
           block: int) -> tuple[int, int]:
    padded, chunk = error_sizes(buffer.numel(), world, block)
    if worker_error.numel() != padded or server_error.numel() != chunk:
        raise ValueError(f"compressed_allreduce: error buffers of {worker_error.numel()}/{server_error.numel()} "
                         f"elements, expected {padded}/{chunk} (error_sizes({buffer.numel()}, {world}))")
    return padded, chunk


def compressed_allreduce(buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                         group: Any = None, block: int = BLOCK) -> torch.Tensor:
    """The 1-bit compressed average of ``buffer`` over ``group`` (a new fp32 tensor of ``buffer``'s shape).

    ``worker_error`` / ``server_error`` (fp32, sizes from ``error_sizes``, zeros at first) are updated in place.
    """
    from deepspeed import comm

    world = dist.get_world_size(group)
    padded, chunk = _check(buffer, worker_error, server_error, world, block)
    b = block_size(buffer.numel(), world, block)
    n = buffer.numel()
    x = torch.zeros(padded, dtype=torch.float32, device=buffer.device)
    x[:n] = buffer.reshape(-1)
    x.add_(worker_error)
    bits, scales, error = _compress(x, b)
    worker_error.copy_(error)
    worker_error[n:] = 0
    packed = pack_signs(bits)
    recv_bits = torch.empty_like(packed)
    recv_scales = torch.empty_like(scales)
    comm.all_to_all_single(recv_bits, packed, group=group, log_name="onebit_worker_signs")
    comm.all_to_all_single(recv_scales, scales, group=group, log_name="onebit_worker_scales")
    mine = _decompress(unpack_signs(recv_bits), recv_scales, b).view(world, chunk).mean(dim=0)
    mine.add_(server_error)
    server_bits, server_scales, server_err = _compress(mine, b)
    server_error.copy_(server_err)
    start = dist.get_rank(group) * chunk
    server_error[max(0, min(chunk, n - start)):] = 0  # padding beyond the tensor carries no error
    all_bits = torch.empty(padded // 8, dtype=torch.uint8, device=buffer.device)
    all_scales = torch.empty(padded // b, dtype=torch.float32, device=buffer.device)
    comm.all_gather_into_tensor(all_bits, pack_signs(server_bits), group=group, log_name="onebit_server_signs")
    comm.all_gather_into_tensor(all_scales, server_scales, group=group, log_name="onebit_server_scales")
    return _decompress(unpack_signs(all_bits), all_scales, b)[:n].view(buffer.shape)


def reference_compressed_allreduce(buffers: list[torch.Tensor], worker_errors: list[torch.Tensor],
                                   server_errors: list[torch.Tensor], block: int = BLOCK) -> torch.Tensor:
    """``compressed_allreduce`` of every rank's ``buffers[r]`` computed in one process (errors updated in place)."""
    world = len(buffers)
    n = buffers[0].numel()
    padded, chunk = _check(buffers[0], worker_errors[0], server_errors[0], world, block)
    b = block_size(n, world, block)
    decompressed = []
    for buf, werr in zip(buffers, worker_errors, strict=True):
        x = torch.zeros(padded)
        x[:n] = buf.reshape(-1).float()
        x += werr
        bits, scales, error = _compress(x, b)
        werr.copy_(error)
        werr[n:] = 0
        decompressed.append(_decompress(bits, scales, b))
    average = torch.stack(decompressed).mean(dim=0)
    out = []
    for r, serr in enumerate(server_errors):
        mine = average[r * chunk:(r + 1) * chunk] + serr
        bits, scales, error = _compress(mine, b)
        serr.copy_(error)
        serr[max(0, min(chunk, n - r * chunk)):] = 0
        out.append(_decompress(bits, scales, b))
    return torch.cat(out)[:n].view(buffers[0].shape)
