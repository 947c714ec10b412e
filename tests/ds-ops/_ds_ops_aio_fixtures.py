"""Shared helpers for the ds_ops.aio tests (importable by name: conftest.py puts tests/ds-ops on sys.path)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator

import pytest
import torch

from ds_ops.aio import AsyncIOHandle, libaio_unavailable_reason

BACKENDS = ["threads"] + ([] if libaio_unavailable_reason() else ["libaio"])
PAGE = os.sysconf("SC_PAGE_SIZE")

ALL_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
]


def random_tensor(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (bool is kept to 0/1 so every value is valid)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g).view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                    b.reshape(-1).view(torch.uint8))


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def aio_rings() -> int:
    """io contexts mapped in this process (each shows as an ``[aio]`` mapping)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "[aio]" in line)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_handle(backend: str) -> Iterator:
    handles = []

    def make(**kwargs) -> AsyncIOHandle:
        h = AsyncIOHandle(backend=backend, **kwargs)
        handles.append(h)
        return h

    yield make
    for h in handles:
        h.close()


@contextlib.contextmanager
def small_tmpfs(size: str = "256k", ro: bool = False) -> Iterator[str]:
    """A freshly mounted tmpfs of ``size`` (skips the test where mounting is not permitted)."""
    path = tempfile.mkdtemp(prefix="ds-aio-tmpfs-")
    opts = f"size={size}" + (",ro" if ro else "")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], capture_output=True, text=True)
    if res.returncode != 0:
        os.rmdir(path)
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", path], check=False)
        os.rmdir(path)


def misaligned(nbytes: int, by: int) -> torch.Tensor:
    """A uint8 tensor whose address is ``by`` bytes past a 4096-byte boundary (so O_DIRECT needs staging)."""
    base = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
    shift = (by - base.data_ptr()) % PAGE
    return base[shift : shift + nbytes]
