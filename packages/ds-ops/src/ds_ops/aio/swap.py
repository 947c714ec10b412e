"""Swap a list of CPU tensors out to a directory and back in, through an ``AsyncIOHandle``.

Layout: either one file per tensor (``tensor_00000.bin``, ...) or one packed file (``tensors.bin``) with
every tensor starting on a page boundary (so O_DIRECT applies), plus ``swap_index.json`` naming file,
offset, byte count, dtype and shape of each tensor. The index is removed before and rewritten after the data,
and every data file is renamed into place only when complete, so a directory is never left with an index
that describes half-written data.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import torch

from ds_ops.aio._errors import AioError
from ds_ops.aio._files import PAGE_SIZE
from ds_ops.aio._handle import AsyncIOHandle
from ds_ops.aio._memory import aligned_empty

INDEX_NAME = "swap_index.json"
PACKED_NAME = "tensors.bin"
_FORMAT = "ds-aio-swap"
_VERSION = 1


@dataclass(frozen=True)
class SwapEntry:
    """Where one tensor lives: ``file`` (relative to the directory), byte ``offset`` and ``nbytes``."""

    file: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@contextlib.contextmanager
def _handle_for(handle: AsyncIOHandle | None) -> Iterator[AsyncIOHandle]:
    if handle is not None:
        yield handle
        return
    with AsyncIOHandle() as own:
        yield own


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: object, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: unknown dtype {name!r}")
    return dtype


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def swap_out(
    tensors: Sequence[torch.Tensor],
    directory: str | os.PathLike,
    *,
    handle: AsyncIOHandle | None = None,
    packed: bool = False,
) -> list[SwapEntry]:
    """Write ``tensors`` (CPU, contiguous) under ``directory`` (created if missing); return their entries."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    index = os.path.join(directory, INDEX_NAME)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(index)
    entries = _layout(tensors, packed)
    with _handle_for(handle) as h:
        if packed:
            _write_packed(h, tensors, entries, directory)
        else:
            calls = [functools.partial(h.async_pwrite, t, os.path.join(directory, e.file), whole_file=True)
                     for t, e in zip(tensors, entries, strict=True)]
            _all_or_nothing(h, calls)
    _write_index(index, entries)
    return entries


def _all_or_nothing(h: AsyncIOHandle, calls: list[functools.partial]) -> None:
    """Start every request, then wait; if one cannot start, the started ones still finish before raising."""
    try:
        for call in calls:
            call()
    except BaseException:
        with contextlib.suppress(Exception):
            h.wait()
        raise
    h.wait()


def _layout(tensors: Sequence[torch.Tensor], packed: bool) -> list[SwapEntry]:
    entries, offset = [], 0
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"swap_out: tensors[{i}] is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"swap_out: tensors[{i}] must be a contiguous CPU tensor (got {tensor.device}, "
                             f"contiguous={tensor.is_contiguous()})")
        nbytes = tensor.numel() * tensor.element_size()
        name = PACKED_NAME if packed else f"tensor_{i:05d}.bin"
        entries.append(SwapEntry(name, offset if packed else 0, nbytes, _dtype_name(tensor.dtype), tuple(tensor.shape)))
        if packed:
            offset = _round_up(offset + nbytes, PAGE_SIZE)
    return entries


def _write_packed(h: AsyncIOHandle, tensors: Sequence[torch.Tensor], entries: list[SwapEntry], directory: str) -> None:
    final = os.path.join(directory, PACKED_NAME)
    temp = os.path.join(directory, f".{PACKED_NAME}.tmp-{os.getpid()}")
    total = max((e.offset + e.nbytes for e in entries), default=0)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            if total:
                os.posix_fallocate(fd, 0, total)
        except OSError as exc:
            raise AioError("swap_out", final, exc.errno, f"cannot reserve {total} bytes: {exc.strerror}") from None
        finally:
            os.close(fd)
        calls = [functools.partial(h.async_pwrite, t, temp, e.offset, whole_file=False)  # slots of one file
                 for t, e in zip(tensors, entries, strict=True)]
        _all_or_nothing(h, calls)
        os.replace(temp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def _write_index(index: str, entries: list[SwapEntry]) -> None:
    body = {"format": _FORMAT, "version": _VERSION, "tensors": [asdict(e) for e in entries]}
    temp = f"{index}.tmp-{os.getpid()}"
    with open(temp, "w") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, index)


def read_index(directory: str | os.PathLike) -> list[SwapEntry]:
    """The entries of a swapped-out directory; errors name the index file and the bad field."""
    index = os.path.join(os.fspath(directory), INDEX_NAME)
    try:
        with open(index) as f:
            body = json.load(f)
    except FileNotFoundError:
        raise AioError("swap_in", index, 2, "no swap index: nothing was swapped out to this directory") from None
    except (OSError, ValueError) as exc:
        raise AioError("swap_in", index, None, f"unreadable swap index: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != _FORMAT or body.get("version") != _VERSION:
        raise AioError("swap_in", index, None, f"not a {_FORMAT} v{_VERSION} index")
    return [_entry(index, i, raw) for i, raw in enumerate(body.get("tensors", []))]


def _entry(index: str, i: int, raw: object) -> SwapEntry:
    where = f"aio swap_in of {index!r}: tensors[{i}]"
    try:
        entry = SwapEntry(raw["file"], int(raw["offset"]), int(raw["nbytes"]), raw["dtype"], tuple(raw["shape"]))
    except (TypeError, KeyError, ValueError) as exc:
        raise ValueError(f"{where}: malformed entry {raw!r} ({exc})") from None
    if os.path.basename(entry.file) != entry.file or entry.offset < 0 or entry.nbytes < 0:
        raise ValueError(f"{where}: bad file/offset/nbytes in {raw!r}")
    dtype = _parse_dtype(entry.dtype, where)
    size = _element_size(dtype)
    if entry.nbytes % size:
        raise ValueError(f"{where}: {entry.nbytes} bytes is not a multiple of the element size {size} of {dtype}")
    numel = 1
    for dim in entry.shape:
        numel *= dim
    if numel * size != entry.nbytes:
        raise ValueError(
            f"{where}: shape {list(entry.shape)} x {dtype} is {numel * size} bytes, the index says {entry.nbytes}"
        )
    return entry


def swap_in(
    directory: str | os.PathLike,
    *,
    handle: AsyncIOHandle | None = None,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Read back what ``swap_out`` wrote: into ``out`` (matching shapes/dtypes) or new page-aligned tensors."""
    directory = os.fspath(directory)
    entries = read_index(directory)
    targets = _targets(directory, entries, out)
    with _handle_for(handle) as h:
        calls = [functools.partial(h.async_pread, t, os.path.join(directory, e.file), e.offset)
                 for t, e in zip(targets, entries, strict=True)]
        _all_or_nothing(h, calls)
    return list(targets)


def _targets(directory: str, entries: list[SwapEntry], out: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    if out is None:
        return [_new(e) for e in entries]
    if len(out) != len(entries):
        raise ValueError(f"aio swap_in of {directory!r}: out has {len(out)} tensors, the index {len(entries)}")
    for i, (tensor, entry) in enumerate(zip(out, entries, strict=True)):
        if _dtype_name(tensor.dtype) != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise ValueError(
                f"aio swap_in of {directory!r}: out[{i}] is {tuple(tensor.shape)} {tensor.dtype}, "
                f"the swapped tensor {entry.shape} {entry.dtype}"
            )
    return list(out)


def _new(entry: SwapEntry) -> torch.Tensor:
    dtype = _parse_dtype(entry.dtype, "swap_in")
    numel = entry.nbytes // _element_size(dtype)
    tensor, _ = aligned_empty(numel, dtype)
    return tensor.view(entry.shape)


def read_file(path: str | os.PathLike, dtype: torch.dtype, *, handle: AsyncIOHandle | None = None) -> torch.Tensor:
    """A whole raw file as a 1-D tensor of ``dtype``; its size must be a multiple of the element size."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise AioError("read_file", path, exc.errno, f"cannot stat the file: {exc.strerror}") from None
    elem = _element_size(dtype)
    if size % elem:
        detail = f"the size {size} is not a multiple of the element size {elem} of {dtype}"
        raise AioError("read_file", path, None, detail)
    tensor, _ = aligned_empty(size // elem, dtype)
    with _handle_for(handle) as h:
        h.sync_pread(tensor, path)
    return tensor


def remove(directory: str | os.PathLike) -> None:
    """Delete the index and the data files it names (other files in the directory are left alone)."""
    directory = os.fspath(directory)
    entries = read_index(directory)
    os.unlink(os.path.join(directory, INDEX_NAME))
    for name in {e.file for e in entries}:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
