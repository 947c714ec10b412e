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
