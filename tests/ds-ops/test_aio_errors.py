"""ds_ops.aio bad input and faults: each error names the path and the operation; nothing leaks."""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading

import _ds_ops_aio_fixtures as fx
import pytest
import torch

from ds_ops.aio import AioError, AsyncIOHandle, _rings, swap

backend = fx.backend
make_handle = fx.make_handle


def _names(err: BaseException, path, operation: str) -> None:
    text = str(err)
    assert str(path) in text, text
    assert operation in text, text


@pytest.mark.parametrize("operation", ["sync_pwrite", "async_pwrite"])
def test_missing_directory(make_handle, tmp_path, operation):
    h = make_handle()
    path = tmp_path / "nope" / "t.bin"
    with pytest.raises(AioError, match="does not exist") as info:
        getattr(h, operation)(torch.zeros(4), path)
    assert info.value.errno == errno.ENOENT and info.value.operation == operation
    _names(info.value, path, operation)
    assert h.pending() == 0


@pytest.mark.parametrize("operation", ["sync_pread", "async_pread"])
def test_missing_file_and_directory_as_file(make_handle, tmp_path, operation):
    h = make_handle()
    with pytest.raises(AioError, match="does not exist") as info:
        getattr(h, operation)(torch.zeros(4), tmp_path / "absent.bin")
    _names(info.value, tmp_path / "absent.bin", operation)
    with pytest.raises(AioError, match="is a directory") as info:
        h.sync_pwrite(torch.zeros(4), tmp_path)
    _names(info.value, tmp_path, "sync_pwrite")


@pytest.mark.parametrize("operation", ["sync_pread", "async_pread"])
def test_read_past_end_of_file(make_handle, tmp_path, operation):
    h = make_handle()
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(100))
    with pytest.raises(AioError, match="read past end of file") as info:
        getattr(h, operation)(torch.zeros(30), path, 8)  # 120 bytes at offset 8
    _names(info.value, path, operation)
    assert "holds 100" in str(info.value)


def test_non_contiguous_gpu_and_bad_arguments(make_handle, tmp_path):
    h = make_handle()
    path = tmp_path / "x.bin"
    with pytest.raises(ValueError, match="not contiguous") as info:
        h.sync_pwrite(torch.zeros(4, 4).t(), path)
    _names(info.value, path, "sync_pwrite")
    with pytest.raises(ValueError, match="only CPU tensors") as info:
        h.async_pread(torch.empty(4, device="meta"), path)
    _names(info.value, path, "async_pread")
    with pytest.raises(ValueError, match="offset must be a non-negative int"):
        h.sync_pwrite(torch.zeros(4), path, -1)
    with pytest.raises(ValueError, match="whole_file=True needs offset 0"):
        h.sync_pwrite(torch.zeros(4), path, 8, whole_file=True)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        h.sync_pwrite([1, 2], path)
    with pytest.raises(TypeError, match="path must be a str"):
        h.sync_pwrite(torch.zeros(4), 3.5)  # an int is an open descriptor (DeepSpeed's async_pwrite overload)
    assert not path.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensor_rejected(tmp_path):
    with AsyncIOHandle() as h, pytest.raises(ValueError, match="only CPU tensors"):
        h.sync_pwrite(torch.zeros(4, device="cuda"), tmp_path / "g.bin")


def test_size_not_multiple_of_element_size(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(bytes(10))
    with pytest.raises(AioError, match="not a multiple of the element size 4") as info:
        swap.read_file(path, torch.float32)
    _names(info.value, path, "read_file")
    assert torch.equal(swap.read_file(path, torch.int16), torch.zeros(5, dtype=torch.int16))
    swap.swap_out([torch.zeros(3)], tmp_path / "s")
    index = tmp_path / "s" / swap.INDEX_NAME
    body = json.loads(index.read_text())
    body["tensors"][0]["nbytes"] = 10
    index.write_text(json.dumps(body))
    with pytest.raises(ValueError, match="not a multiple of the element size 4") as info:
        swap.swap_in(tmp_path / "s")
    _names(info.value, index, "swap_in")


def test_disk_full_on_small_tmpfs(make_handle):
    h = make_handle(block_size=65536)
    with fx.small_tmpfs("256k") as mnt:
        target = os.path.join(mnt, "full.bin")
        with open(target, "wb") as f:
            f.write(b"old")
        big = torch.zeros(1 << 20, dtype=torch.uint8)
        with pytest.raises(AioError, match="cannot reserve") as info:
            h.sync_pwrite(big, target)  # whole-file write: refused before any byte is written
        assert info.value.errno == errno.ENOSPC
        _names(info.value, target, "sync_pwrite")
        assert os.listdir(mnt) == ["full.bin"] and open(target, "rb").read() == b"old"
        locked = h.new_cpu_locked_tensor(1 << 20, torch.uint8)
        for buffer in (big, locked):  # buffered, then O_DIRECT where tmpfs accepts it
            # in place: the part past the end of the file is reserved first, so a full device fails at the call
            with pytest.raises(AioError, match="cannot extend the file to 1048576 bytes") as info:
                h.async_pwrite(buffer, target, 0, whole_file=False)
            assert info.value.errno == errno.ENOSPC and h.pending() == 0
            _names(info.value, target, "async_pwrite")
            assert os.listdir(mnt) == ["full.bin"] and open(target, "rb").read() == b"old"
        h.free_cpu_locked_tensor(locked)


def test_unwritable_read_only_mount(make_handle):
    h = make_handle()
    with fx.small_tmpfs("64k", ro=True) as mnt:
        target = os.path.join(mnt, "ro.bin")
        with pytest.raises(AioError, match="cannot create a file") as info:
            h.sync_pwrite(torch.zeros(8), target)
        assert info.value.errno == errno.EROFS
        _names(info.value, target, "sync_pwrite")
        with pytest.raises(AioError, match="cannot open the file for writing") as info:
            h.async_pwrite(torch.zeros(8), target, 16)
        _names(info.value, target, "async_pwrite")


_LIMITED_CHILD = textwrap.dedent(
    """
    import json, os, resource, signal, sys, tempfile
    import torch
    from ds_ops.aio import AioError, AsyncIOHandle
    work, backends = sys.argv[1], sys.argv[2:]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
    out = {}
    handles = {b: AsyncIOHandle(block_size=16384, backend=b) for b in backends}
    big = torch.ones(1 << 18, dtype=torch.uint8)
    for b, h in handles.items():
        for name, kwargs in [("whole", {}), ("in_place", {"whole_file": False})]:
            path = os.path.join(work, f"{b}-{name}.bin")
            try:
                h.async_pwrite(big, path, **kwargs)
                h.wait()
                out[f"{b}-{name}"] = "no error"
            except AioError as exc:
                out[f"{b}-{name}"] = [exc.errno, str(exc)]
    out["files"] = sorted(os.listdir(work))
    if os.geteuid() == 0:  # root ignores permissions: check them as nobody
        os.setgid(65534)
        os.setuid(65534)
    locked = tempfile.mkdtemp(prefix="ds-aio-ro-")
    os.chmod(locked, 0o555)
    for b, h in handles.items():
        try:
            h.sync_pwrite(torch.zeros(4), os.path.join(locked, "t.bin"))
            out[f"{b}-unwritable"] = "no error"
        except AioError as exc:
            out[f"{b}-unwritable"] = [exc.errno, str(exc)]
        h.close()
    os.chmod(locked, 0o755)
    os.rmdir(locked)
    print(json.dumps(out))
    """
)


def test_file_size_limit_and_permissions_in_subprocess():
    work = tempfile.mkdtemp(prefix="ds-aio-fsize-")
    os.chmod(work, 0o777)
    try:
        res = subprocess.run([sys.executable, "-c", _LIMITED_CHILD, work, *fx.BACKENDS], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout.strip().splitlines()[-1])
    finally:
        for name in os.listdir(work):
            os.unlink(os.path.join(work, name))
        os.rmdir(work)
    for b in fx.BACKENDS:
        for name in ("whole", "in_place"):
            err, text = out[f"{b}-{name}"]
            assert err == errno.EFBIG and "async_pwrite" in text and f"{b}-{name}.bin" in text
        err, text = out[f"{b}-unwritable"]
        assert err == errno.EACCES and "sync_pwrite" in text and "t.bin" in text
    # the whole-file writes left no temporary behind; in-place writes keep what reached the disk
    assert out["files"] == sorted(f"{b}-in_place.bin" for b in fx.BACKENDS)


def _fail_third_block(monkeypatch):
    real, calls, lock = _rings.perform_sync, [0], threading.Lock()

    def flaky(fd, address, nbytes, offset, write):
        with lock:
            calls[0] += 1
            n = calls[0]
        return -errno.EIO if n == 3 else real(fd, address, nbytes, offset, write)

    monkeypatch.setattr(_rings, "perform_sync", flaky)


def test_failed_write_keeps_old_file_and_wait_raises_first_failure(tmp_path, monkeypatch):
    _fail_third_block(monkeypatch)
    with AsyncIOHandle(block_size=4096, queue_depth=1, backend="threads") as h:
        paths = [tmp_path / f"{i}.bin" for i in range(3)]
        paths[1].write_bytes(b"previous")
        tensors = [fx.random_tensor(8192, torch.uint8, seed=i) for i in range(3)]
        for t, p in zip(tensors, paths, strict=True):
            h.async_pwrite(t, p)  # 2 blocks each: the 3rd block overall (2nd file) fails
        with pytest.raises(AioError, match="Input/output error") as info:
            h.wait()
        _names(info.value, paths[1], "async_pwrite")
        assert paths[1].read_bytes() == b"previous"  # the half-written replacement never took its name
        assert paths[0].read_bytes() == tensors[0].numpy().tobytes()
        assert paths[2].read_bytes() == tensors[2].numpy().tobytes()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["0.bin", "1.bin", "2.bin"]
        assert h.wait() == 0


def test_closed_handle_refuses(tmp_path):
    h = AsyncIOHandle(backend="threads")
    h.close()
    h.close()
    with pytest.raises(RuntimeError, match="closed"):
        h.sync_pwrite(torch.zeros(2), tmp_path / "c.bin")


def test_no_fd_or_io_context_leaks(backend, tmp_path, monkeypatch):
    fds, rings, threads = fx.open_fds(), fx.aio_rings(), threading.active_count()
    h = AsyncIOHandle(block_size=4096, queue_depth=4, thread_count=2, backend=backend)
    if backend == "libaio":
        assert fx.aio_rings() == rings + 2  # one io context per I/O thread
    t = h.new_cpu_locked_tensor(4096 * 5 + 7, torch.uint8)
    for i in range(8):
        h.async_pwrite(t, tmp_path / f"{i}.bin")
    assert h.wait() == 8
    for i in range(8):
        h.sync_pread(t, tmp_path / f"{i}.bin")
    for bad in (lambda: h.sync_pread(t, tmp_path / "none.bin"), lambda: h.sync_pread(t, tmp_path / "0.bin", 9),
                lambda: h.sync_pwrite(t, tmp_path / "no" / "x.bin")):
        with pytest.raises(AioError):
            bad()
    _fail_third_block(monkeypatch)
    h.async_pwrite(torch.zeros(4096), tmp_path / "0.bin", 1)  # odd offset: buffered, through perform_sync
    h.async_pwrite(torch.zeros(4096), tmp_path / "1.bin", 1)
    with pytest.raises(AioError):
        h.wait()
    h.free_cpu_locked_tensor(t)
    h.close()
    dropped = AsyncIOHandle(thread_count=2, backend=backend)  # never closed: garbage collection releases it
    dropped.sync_pwrite(torch.ones(5), tmp_path / "gc.bin")
    del dropped
    gc.collect()
    assert fx.open_fds() == fds
    assert fx.aio_rings() == rings
    assert threading.active_count() == threads
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_broken_ring_fails_requests_instead_of_hanging(tmp_path, monkeypatch):
    real = _rings.ThreadRing.reap
    calls = [0]

    def reap_once_broken(self, min_nr):
        calls[0] += 1
        if calls[0] == 1:
            raise OSError(errno.EIO, "simulated io_getevents failure")
        return real(self, min_nr)

    monkeypatch.setattr(_rings.ThreadRing, "reap", reap_once_broken)
    with AsyncIOHandle(block_size=4096, backend="threads") as h:
        path = tmp_path / "r.bin"
        with pytest.raises(AioError, match="I/O worker failed") as info:
            h.sync_pwrite(torch.ones(10000), path)
        _names(info.value, path, "sync_pwrite")
        assert not path.exists() and os.listdir(tmp_path) == []
        t = torch.arange(10000, dtype=torch.float32)
        h.sync_pwrite(t, path)  # a fresh ring serves the next request
        assert path.read_bytes() == t.numpy().tobytes()
