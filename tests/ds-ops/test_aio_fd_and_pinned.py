"""The aio handle's descriptor I/O (``fd=``, DeepSpeed's ``async_pwrite(buffer, fd, offset)`` overload), the
process-wide locked-buffer manager (``is_pinned`` across handles) and the ``pin_memory`` op's ``pin_handle``."""

from __future__ import annotations

import gc
import itertools
import os
import random
import time

import _ds_ops_aio_fixtures as fx
import pytest
import torch

import ds_ops.op_builder as op_builder
from ds_ops.aio import AioError, PinMemoryBuilder, is_pinned
from ds_ops.aio._memory import live_buffers

_O_DIRECT = getattr(os, "O_DIRECT", 0)
backend = fx.backend
make_handle = fx.make_handle


def _file_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("flags", [os.O_WRONLY, os.O_WRONLY | _O_DIRECT, os.O_WRONLY | os.O_APPEND],
                         ids=["plain", "o_direct", "o_append"])
def test_async_fd_writes_repeated_bitwise(make_handle, tmp_path, flags):
    """Pieces of one locked buffer written through caller descriptors at their offsets, several in flight at once
    with jittered submission, equal the buffer byte for byte on every repetition (an O_APPEND descriptor
    included: the handle writes at the offsets asked for)."""
    h = make_handle(block_size=4096, queue_depth=2, single_submit=False, overlap_events=True, thread_count=2)
    rng = random.Random(7)
    size = 64 * 4096 + 300  # an unaligned tail goes through the page cache
    src = h.new_cpu_locked_tensor(size, torch.uint8)
    src.copy_(fx.random_tensor(size, torch.uint8, seed=3))
    for rep in range(5):
        path = tmp_path / f"fd_{rep}.bin"
        path.write_bytes(b"")
        cuts = sorted(rng.sample(range(1, 64), 5))
        bounds = [0, *(c * 4096 for c in cuts), size]
        fds = []
        for start, end in itertools.pairwise(bounds):
            fd = os.open(path, flags | os.O_CREAT)
            fds.append(fd)
            assert h.async_pwrite(src.narrow(0, start, end - start), fd, start) == 0  # positional: DeepSpeed's overload
            time.sleep(rng.random() * 0.002)
        assert h.wait() == len(fds)
        for fd in fds:
            os.close(fd)
        assert _file_bytes(path) == src.numpy().tobytes(), f"repetition {rep}"
    assert h.free_cpu_locked_tensor(src) is True


def test_fd_keyword_read_and_write_match_path_io(make_handle, tmp_path):
    h = make_handle(block_size=8192, queue_depth=4)
    t = fx.random_tensor(10_000, torch.float32, seed=1)  # a plain tensor: staged through aligned blocks
    path = tmp_path / "kw.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        assert h.sync_pwrite(t, fd=fd, file_offset=4096) == 1
        out = torch.empty_like(t)
        assert h.async_pread(out, fd=fd, file_offset=4096) == 0 and h.wait() == 1
        assert fx.same_bytes(out, t)
        assert os.fstat(fd).st_size == 4096 + t.nbytes
        os.lseek(fd, 0, os.SEEK_SET)  # the caller's descriptor is still theirs and open
        assert os.read(fd, 4096) == bytes(4096)
    finally:
        os.close(fd)
    assert h.sync_pread(out.zero_(), str(path), 4096) == 1 and fx.same_bytes(out, t)


def test_fd_arguments_are_checked(make_handle, tmp_path):
    h = make_handle()
    path = tmp_path / "ro.bin"
    path.write_bytes(bytes(64))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(AioError, match="read-only"):
            h.sync_pwrite(torch.zeros(4), fd=fd)
        with pytest.raises(AioError, match="read past end of file"):
            h.sync_pread(torch.zeros(100), fd=fd)
        with pytest.raises(ValueError, match="whole_file=True needs a path"):
            h.sync_pwrite(torch.zeros(4), fd=fd, whole_file=True)
    finally:
        os.close(fd)
    with pytest.raises(AioError, match="not an open file descriptor"):
        h.sync_pwrite(torch.zeros(4), fd=fd)  # closed now
    with pytest.raises(TypeError, match="exactly one of filename"):
        h.async_pwrite(torch.zeros(4), str(path), fd=3)
    with pytest.raises(TypeError, match="exactly one of filename"):
        h.async_pwrite(torch.zeros(4))
    with pytest.raises(ValueError, match="fd must be a non-negative int"):
        h.async_pwrite(torch.zeros(4), fd=-2)
    assert h.pending() == 0


def test_alignment_is_deepspeeds_figure(make_handle):
    assert make_handle(thread_count=1).get_alignment() == 512
    assert make_handle(thread_count=4).get_alignment() == 2048


def test_locked_buffers_are_process_wide_and_views_count(make_handle):
    a, b = make_handle(), make_handle()
    buf = a.new_cpu_locked_tensor(4096, torch.float32)
    plain = torch.empty(4096)
    assert a.is_pinned(buf) and b.is_pinned(buf) and b.is_pinned(buf.narrow(0, 1024, 1024)) and b.is_pinned(buf[5])
    assert not a.is_pinned(plain) and not is_pinned(torch.empty(2, device="meta"))
    # a tensor that starts inside a buffer but runs 16 bytes past its end is not pinned (its tail is not locked)
    overrun = torch.empty(0).set_(buf.untyped_storage(), buf.storage_offset() + 4000, (100,))
    assert overrun.data_ptr() == buf.data_ptr() + 16000 and not a.is_pinned(overrun)
    assert a.is_pinned(overrun[:96])
    assert b.free_cpu_locked_tensor(buf) is True  # freed through the other handle
    assert not a.is_pinned(buf) and a.free_cpu_locked_tensor(buf) is False


def test_pin_memory_op_shares_the_manager(make_handle):
    assert PinMemoryBuilder().is_compatible() and op_builder.PinMemoryBuilder is PinMemoryBuilder
    ph = op_builder.PinMemoryBuilder().load().pin_handle()
    h = make_handle()
    before = live_buffers()
    x = ph.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.bfloat16))
    y = h.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.int64))
    assert x.dtype == torch.bfloat16 and x.data_ptr() % fx.PAGE == 0 and x._base is None
    assert h.is_pinned(x.narrow(0, 10, 10)) and ph.is_pinned(y) and live_buffers() == before + 2
    assert ph.free_cpu_locked_tensor_by_ptr(y.data_ptr()) is True and ph.free_cpu_locked_tensor(x) is True
    assert ph.free_cpu_locked_tensor(x) is False and live_buffers() == before
    with pytest.raises(TypeError, match="example_tensor"):
        ph.new_cpu_locked_tensor(4, torch.float32)


def test_freed_buffer_fails_loudly_instead_of_aliasing():
    ph = PinMemoryBuilder().load().pin_handle()
    x = ph.new_cpu_locked_tensor(256, torch.empty(0))
    view = x.narrow(0, 0, 16)
    ph.free_cpu_locked_tensor(x)
    gc.collect()
    with pytest.raises(RuntimeError, match="out of bounds"):
        x.narrow(0, 0, 4).view(-1)
    assert view.untyped_storage().nbytes() == 0


def test_in_place_writes_reserve_only_past_the_end(make_handle, tmp_path):
    """An in-place write reserves the part past the end of the file up front (O_DIRECT extending writes would run
    synchronously in io_submit) and never shrinks a longer file."""
    h = make_handle(block_size=4096, queue_depth=4)
    path = tmp_path / "inplace.bin"
    path.write_bytes(b"\x01" * 20_000)
    head = fx.random_tensor(4096, torch.uint8, seed=5)
    assert h.sync_pwrite(head, str(path), 0, whole_file=False) == 1
    assert path.stat().st_size == 20_000 and _file_bytes(path)[:4096] == head.numpy().tobytes()
    tail = fx.random_tensor(3 * 4096, torch.uint8, seed=6)
    fd = os.open(path, os.O_WRONLY)
    try:
        assert h.async_pwrite(tail, fd, 24_576) == 0 and h.wait() == 1
    finally:
        os.close(fd)
    data = _file_bytes(path)
    assert len(data) == 24_576 + tail.numel() and data[20_000:24_576] == bytes(4576)
    assert data[24_576:] == tail.numpy().tobytes() and data[4096:20_000] == b"\x01" * 15_904


def test_deepspeed_memcpy_copies_bytes_and_checks_its_arguments():
    from ds_ops.aio.async_io import deepspeed_memcpy

    src = fx.random_tensor(10_001, torch.float64, seed=9)
    dst = torch.empty(10_001 * 8, dtype=torch.uint8)
    assert deepspeed_memcpy(dst, src) == 0 and fx.same_bytes(dst.view(torch.float64), src)
    with pytest.raises(ValueError, match="dest holds 80008 bytes but src 8"):
        deepspeed_memcpy(dst, torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="src must be a contiguous CPU tensor"):
        deepspeed_memcpy(torch.empty(4), torch.zeros(4, 2)[:, 0])
