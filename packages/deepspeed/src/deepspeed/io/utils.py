"""Byte views for the writers: Python buffers and torch storages as flat uint8 tensors, without copies."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class serialize_details:  # noqa: N801 - DeepSpeed's name
    """A storage ``torch.save`` hands a writer: the storage, its element dtype, its element count and bytes."""

    obj: Any
    dtype: torch.dtype
    size: int
    nbytes: int


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def bytes_to_tensor(buffer: bytes | bytearray | memoryview) -> torch.Tensor:
    """A 1-D uint8 tensor over ``buffer``'s memory (no copy; a read-only buffer is only read)."""
    view = memoryview(buffer).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    import warnings

    with warnings.catch_warnings():  # torch warns that a read-only buffer could be written through: it is not
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def _storage_details(storage_obj: Any) -> serialize_details:
    storage, dtype = storage_obj  # torch's pair: an untyped storage and the dtype of its elements
    nbytes = storage.nbytes()
    return serialize_details(obj=storage, dtype=dtype, size=nbytes // torch._utils._element_size(dtype),
                             nbytes=nbytes)


def obj_serialization_details() -> Callable[[Any], serialize_details]:
    """The function describing one ``(untyped storage, dtype)`` pair (torch's storage objects since 1.12)."""
    return _storage_details


def cast_to_byte_tensor(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's bytes as a flat uint8 view (contiguous tensors are not copied)."""
    return [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]


def storage_byte_tensors(storage_obj_list: Sequence[Any], save_size: bool) -> list[torch.Tensor]:
    """The byte stream of ``save_torch_storage_object_list``: per storage, its element count as a little-endian
    int64 when ``save_size``, then its bytes (host copies of device storages)."""
    out: list[torch.Tensor] = []
    for storage_obj in storage_obj_list:
        details = _storage_details(storage_obj)
        if save_size:
            out.append(torch.tensor([details.size], dtype=torch.int64).view(torch.uint8))
        data = torch.empty(0, dtype=torch.uint8, device=details.obj.device).set_(details.obj)
        out.append(data.cpu() if data.device.type != "cpu" else data)
    return out


def partition_bytes(pieces: Sequence[torch.Tensor], num_parts: int, part: int) -> list[torch.Tensor]:
    """Part ``part`` of ``num_parts`` contiguous shares of the concatenated byte tensors (the first
    ``total % num_parts`` shares one byte longer), as views of the pieces it overlaps."""
    total = sum(p.numel() for p in pieces)
    size, extra = divmod(total, num_parts)
    start = part * size + min(part, extra)
    end = start + size + (1 if part < extra else 0)
    share, offset = [], 0
    for piece in pieces:
        lo, hi = max(start, offset), min(end, offset + piece.numel())
        if lo < hi:
            share.append(piece.narrow(0, lo - offset, hi - lo))
        offset += piece.numel()
    return share
