"""The ZeRO-Infinity swap machinery on its own (one process, a temp dir): the optimizer swapper's streamed step
gives the same files pipelined and sequential and never holds more buffers than ``buffer_count``; the
parameter swapper keeps ``max_in_cpu`` elements in memory, prefetches no further than its pool, and a truncated
file is an error naming it."""

from __future__ import annotations

import os
import types

import pytest
import torch

from ds_ops.aio import AioError
from ds_zero.swap import BufferPool, OptimizerSwapper, OptimizerSwapSettings, ParamSwapper, ParamSwapSettings


def _swapper(tmp_path, name: str, **kw: object) -> OptimizerSwapper:
    folder = tmp_path / name
    folder.mkdir()
    settings = OptimizerSwapSettings(nvme_path=str(folder), aio={"block_size": 4096, "queue_depth": 2}, **kw)
    return OptimizerSwapper(settings, rank=0, largest_numel=50)


def _train(swapper: OptimizerSwapper, sizes: list[int]) -> tuple[list[dict], int]:
    swapper.init_masters((i, lambda n=n, i=i: torch.arange(n, dtype=torch.float32) + i) for i, n in enumerate(sizes))
    most = 0

    def step(i: int, tensors: dict) -> dict:
        nonlocal most
        most = max(most, swapper.pool.count - swapper.pool.free)
        master = tensors["master"]
        avg = tensors.get("avg", torch.zeros_like(master))
        avg.mul_(0.5).add_(master)  # a state that depends on the one read back
        master.add_(1.0)
        return {"master": master, "avg": avg}

    for _ in range(3):
        swapper.run(list(range(len(sizes))), step)
    return [swapper.read_new(i) for i in range(len(sizes))], most


def test_pipelined_step_equals_sequential_and_stays_in_its_buffers(tmp_path):
    sizes = [50, 7, 33, 50]
    plain, plain_most = _train(_swapper(tmp_path, "seq", buffer_count=2), sizes)
    piped = _swapper(tmp_path, "pipe", buffer_count=6, pipeline_read=True, pipeline_write=True, fast_init=True)
    got, most = _train(piped, sizes)
    assert plain_most <= 2 and most <= 6
    assert most > 2  # the pipelined run really had the next read / the last write in flight
    for i, n in enumerate(sizes):
        want = torch.arange(n, dtype=torch.float32) + i + 3
        assert torch.equal(plain[i]["master"], want) and torch.equal(got[i]["master"], want)
        assert torch.equal(plain[i]["avg"], got[i]["avg"])
    folder = piped.folder
    piped.close()
    assert not os.path.exists(folder)


def test_optimizer_swap_truncated_file_is_an_error_naming_it(tmp_path):
    swapper = _swapper(tmp_path, "t", buffer_count=2)
    swapper.init_masters([(0, lambda: torch.ones(40))])
    path = swapper.path(0, "master")
    os.truncate(path, 16)
    with pytest.raises(AioError, match="swap in optimizer sub-group 0") as err:
        swapper.run([0], lambda i, t: t)
    assert path in str(err.value)


def _param(ds_id: int, numel: int) -> types.SimpleNamespace:
    part = torch.arange(numel, dtype=torch.bfloat16) + ds_id
    return types.SimpleNamespace(ds_id=ds_id, ds_tensor=part, ds_shape=(numel,))


def test_param_swapper_max_in_cpu_prefetch_and_round_trip(tmp_path):
    settings = ParamSwapSettings(nvme_path=str(tmp_path), buffer_count=2, buffer_size=64, max_in_cpu=20)
    swapper = ParamSwapper(settings, rank=0)
    params = [_param(i, n) for i, n in enumerate([16, 30, 30, 30, 4])]
    for p in params:
        swapper.adopt(p)
    # first come, first kept: 16 + 4 elements fit max_in_cpu=20, the 30s go to NVMe
    assert [p.ds_tensor.device.type for p in params] == ["cpu", "meta", "meta", "meta", "cpu"]
    assert swapper.in_cpu_numel == 20
    assert swapper.prefetch(params) == 2  # the pool holds 2
    swapper.swap_in(params[1:4])  # one more than the pool: a temporary buffer
    for p in params:
        assert torch.equal(p.ds_tensor, torch.arange(p.ds_tensor.numel(), dtype=torch.bfloat16) + p.ds_id)
    swapper.write(params[2], torch.full((30,), 7.0))
    swapper.release(params)
    assert params[2].ds_tensor.device.type == "meta"
    assert torch.equal(swapper.read_copy(params[2]), torch.full((30,), 7.0, dtype=torch.bfloat16))
    swapper.close()


def test_buffer_pool_is_bounded():
    pool = BufferPool(2, 10, torch.float32)
    a, b = pool.get(), pool.get()
    assert pool.get() is None and pool.get_many(1) is None
    assert a.data_ptr() % 4096 == 0  # page-aligned: O_DIRECT without a bounce copy
    pool.put(a)
    with pytest.raises(ValueError, match="not a buffer of the pool"):
        pool.put(a)
    pool.put(b)
    assert pool.free == 2


def test_swap_uses_only_the_public_surface_of_ds_ops_aio():
    """ds_zero builds on ``ds_ops.aio``'s documented names, never on its private modules."""
    import ast

    import ds_ops.aio as aio
    import ds_zero

    root = os.path.dirname(ds_zero.__file__)
    private = []
    for folder, _, files in os.walk(root):
        for name in (f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name)) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                private += [m for m in mods if m.startswith("ds_ops") and any(s.startswith("_") for s in m.split("."))]
    assert private == []
    t = aio.page_aligned_empty(1000, torch.float16)
    assert t.numel() == 1000 and t.dtype == torch.float16 and t.data_ptr() % 4096 == 0
    locked = aio.new_cpu_locked_tensor(100, torch.float32)
    assert locked.data_ptr() % 4096 == 0 and aio.is_locked_tensor(locked)
    aio.free_cpu_locked_tensor(locked)
    assert not aio.is_locked_tensor(locked)
    with pytest.raises(ValueError, match="numel"):
        aio.page_aligned_empty(-1, torch.float32)


def test_optimizer_swapper_recovers_after_a_failed_step(tmp_path):
    """A step that fails midway (here the optimizer raises on the second sub-group, the first one's write in
    flight) leaves no buffer out of the pool and no write in flight: the next run reads what was written."""
    swapper = _swapper(tmp_path, "fail", buffer_count=4, pipeline_read=True, pipeline_write=True)
    swapper.init_masters((i, lambda i=i: torch.full((50,), float(i))) for i in range(3))

    def bad(i: int, tensors: dict) -> dict:
        if i == 1:
            raise RuntimeError("optimizer failed")
        tensors["master"].add_(10.0)
        return tensors

    with pytest.raises(RuntimeError, match="optimizer failed"):
        swapper.run([0, 1, 2], bad)
    assert swapper.pool.free == swapper.pool.count
    swapper.run([0, 1, 2], lambda i, t: t)  # would fail on buffer_count (buffers lost) before the fix
    assert torch.equal(swapper.read_new(0)["master"], torch.full((50,), 10.0))
    assert torch.equal(swapper.read_new(1)["master"], torch.full((50,), 1.0))
    swapper.close()


def test_param_swapper_failed_read_is_never_installed(tmp_path, monkeypatch):
    """An I/O error reported at ``wait`` (EIO from the device; injected here, after the real wait) must not
    leave the batch's buffers to be installed later as if they held the partitions."""
    settings = ParamSwapSettings(nvme_path=str(tmp_path), buffer_count=2, buffer_size=64, max_in_cpu=0)
    swapper = ParamSwapper(settings, rank=0)
    params = [_param(0, 40), _param(1, 40)]
    for p in params:
        swapper.adopt(p)
    real_wait = swapper.reader.wait

    def failing_wait() -> int:
        real_wait()
        raise AioError("async_pread", swapper.path(params[1]), 5, "injected I/O error")

    assert swapper.prefetch(params) == 2
    monkeypatch.setattr(swapper.reader, "wait", failing_wait)
    with pytest.raises(AioError, match="swap in parameter partitions") as err:
        swapper.swap_in(params)
    assert swapper.path(params[1]) in str(err.value)
    assert not swapper.reading and not swapper.resident
    assert all(p.ds_tensor.device.type == "meta" for p in params)
    assert swapper._pools[torch.bfloat16].free == 2  # the buffers went back
    monkeypatch.setattr(swapper.reader, "wait", real_wait)
    swapper.swap_in(params)  # read again, not the failed batch's buffers
    for p in params:
        assert torch.equal(p.ds_tensor, torch.arange(40, dtype=torch.bfloat16) + p.ds_id)
    swapper.close()


def test_param_write_during_a_prefetch_wins(tmp_path):
    """A partition rewritten while its prefetch is in flight (a ``GatheredParameters`` modifier, a debug setter)
    must be gathered with the new value, not the one the prefetch read."""
    settings = ParamSwapSettings(nvme_path=str(tmp_path), buffer_count=2, buffer_size=64, max_in_cpu=0)
    swapper = ParamSwapper(settings, rank=0)
    p = _param(0, 40)
    swapper.adopt(p)
    assert swapper.prefetch([p]) == 1
    swapper.write(p, torch.full((40,), 3.0))
    swapper.swap_in([p])
    assert torch.equal(p.ds_tensor, torch.full((40,), 3.0, dtype=torch.bfloat16))
    swapper.release([p])
    assert torch.equal(swapper.read_copy(p), torch.full((40,), 3.0, dtype=torch.bfloat16))
    swapper.close()


def test_rewrites_overwrite_the_file_in_place(tmp_path):
    """A tensor's first write creates its file; later writes of the same size overwrite that file (same inode,
    no temporary file, right bytes), and the bandwidth counters hold only waited-for swaps."""
    settings = OptimizerSwapSettings(nvme_path=str(tmp_path), aio={"block_size": 4096}, fast_init=True)
    swapper = OptimizerSwapper(settings, rank=0, largest_numel=1024)
    swapper.init_masters([(0, lambda: torch.arange(1024, dtype=torch.float32))])
    assert swapper.stats.write_bytes == 0  # fast_init's writes overlap the preparation: not a bandwidth sample
    swapper.run([0], lambda i, t: {"master": t["master"].add_(1), "avg": t["master"] * 2})
    inodes = {n: os.stat(swapper.path(0, n)).st_ino for n in ("master", "avg")}
    swapper.stats.reset()
    swapper.run([0], lambda i, t: {"master": t["master"].add_(1), "avg": t["avg"].add_(1)})
    assert {n: os.stat(swapper.path(0, n)).st_ino for n in inodes} == inodes
    assert sorted(os.listdir(swapper.folder)) == ["0_avg.tensor.swp", "0_master.tensor.swp"]
    got = swapper.read_new(0)
    assert torch.equal(got["master"], torch.arange(1024, dtype=torch.float32) + 2)
    assert torch.equal(got["avg"], (torch.arange(1024, dtype=torch.float32) + 1) * 2 + 1)
    assert swapper.stats.write_bytes == 2 * 1024 * 4 and swapper.stats.write_s > 0
    swapper.close()

    params = ParamSwapper(ParamSwapSettings(nvme_path=str(tmp_path), max_in_cpu=0, buffer_count=2,
                                            buffer_size=64, aio={"block_size": 4096}), rank=0)
    p = _param(7, 64)
    params.adopt(p)
    first = os.stat(params.path(p)).st_ino
    params.write(p, torch.full((64,), 3.0))
    assert os.stat(params.path(p)).st_ino == first
    assert torch.equal(params.read_copy(p), torch.full((64,), 3.0))
    params.close()
