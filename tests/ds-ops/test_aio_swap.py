"""ds_ops.aio.swap and the DeepSpeed-facing names (deepspeed.ops.aio, AsyncIOBuilder)."""

from __future__ import annotations

import json
import os

import _ds_ops_aio_fixtures as fx
import pytest
import torch

import ds_ops.aio
from ds_ops.aio import AioError, AsyncIOBuilder, AsyncIOHandle, aio_handle, swap

backend = fx.backend
make_handle = fx.make_handle


def _tensors():
    return [
        fx.random_tensor(1000, torch.float32, seed=1).view(10, 100),
        fx.random_tensor(4097, torch.bfloat16, seed=2),
        fx.random_tensor(3, torch.int64, seed=3),
        torch.empty(0, dtype=torch.float16),
        fx.random_tensor(65536, torch.uint8, seed=4).view(2, 2, -1),
        fx.random_tensor(7, torch.bool, seed=5),
    ]


@pytest.mark.parametrize("packed", [False, True])
def test_swap_round_trip(make_handle, tmp_path, packed):
    h = make_handle(block_size=16384, thread_count=2)
    tensors = _tensors()
    entries = swap.swap_out(tensors, tmp_path / "swap", handle=h, packed=packed)
    files = sorted(os.listdir(tmp_path / "swap"))
    if packed:
        assert files == [swap.INDEX_NAME, swap.PACKED_NAME]
        assert all(e.offset % fx.PAGE == 0 for e in entries)  # page-aligned slots: O_DIRECT applies
    else:
        assert files == [swap.INDEX_NAME] + [f"tensor_{i:05d}.bin" for i in range(len(tensors))]
    back = swap.swap_in(tmp_path / "swap", handle=h)
    assert all(fx.same_bytes(b, t) for b, t in zip(back, tensors, strict=True))
    assert all(b.data_ptr() % fx.PAGE == 0 for b in back if b.numel())
    out = [torch.empty_like(t) for t in tensors]
    assert swap.swap_in(tmp_path / "swap", handle=h, out=out) == out
    assert all(fx.same_bytes(o, t) for o, t in zip(out, tensors, strict=True))
    assert swap.read_index(tmp_path / "swap") == entries
    swap.remove(tmp_path / "swap")
    assert os.listdir(tmp_path / "swap") == []


def test_swap_default_handle_and_replacement(tmp_path):
    first = [torch.arange(10.0)]
    swap.swap_out(first, tmp_path, packed=True)
    second = [torch.arange(5, dtype=torch.int32), torch.ones(3)]
    swap.swap_out(second, tmp_path)  # a later swap replaces the index and its description
    back = swap.swap_in(tmp_path)
    assert [b.dtype for b in back] == [torch.int32, torch.float32]
    assert torch.equal(back[0], second[0]) and torch.equal(back[1], second[1])


def test_swap_errors(tmp_path):
    with pytest.raises(AioError, match="no swap index") as info:
        swap.swap_in(tmp_path)
    assert swap.INDEX_NAME in str(info.value) and "swap_in" in str(info.value)
    swap.swap_out([torch.zeros(4)], tmp_path)
    with pytest.raises(ValueError, match=r"out\[0\] is \(5,\) torch.float32"):
        swap.swap_in(tmp_path, out=[torch.zeros(5)])
    with pytest.raises(ValueError, match="out has 2 tensors"):
        swap.swap_in(tmp_path, out=[torch.zeros(4), torch.zeros(4)])
    with pytest.raises(TypeError, match=r"tensors\[1\] is a list"):
        swap.swap_out([torch.zeros(1), [1]], tmp_path / "t")
    (tmp_path / "tensor_00000.bin").write_bytes(bytes(8))  # truncated data file
    with pytest.raises(AioError, match="read past end of file") as info:
        swap.swap_in(tmp_path)
    assert "tensor_00000.bin" in str(info.value)
    index = tmp_path / swap.INDEX_NAME
    body = json.loads(index.read_text())
    body["tensors"][0]["dtype"] = "float33"
    index.write_text(json.dumps(body))
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        swap.swap_in(tmp_path)
    index.write_text("{not json")
    with pytest.raises(AioError, match="unreadable swap index"):
        swap.swap_in(tmp_path)


def test_builder_and_deepspeed_paths(tmp_path):
    builder = AsyncIOBuilder()
    assert builder.NAME == "async_io" and builder.is_compatible() is True
    module = builder.load()
    assert module.aio_handle is AsyncIOHandle is aio_handle
    # the op module serves the very objects ds_ops.aio exports (ds_ops.aio adds swap and the builder)
    assert module.__all__ and all(getattr(module, name) is getattr(ds_ops.aio, name) for name in module.__all__)
    h = module.aio_handle(1048576, 8, False, True, 1)  # DeepSpeed's positional order
    t = torch.arange(100, dtype=torch.float32)
    assert h.sync_pwrite(t, str(tmp_path / "ds.bin")) == 1
    h.close()
    assert builder.compatibility_problems() == [] and builder.is_built() in ("libaio", "threads")
    import deepspeed.ops.aio as ds_aio
    from deepspeed.ops.op_builder import AsyncIOBuilder as ds_builder

    assert ds_aio.aio_handle is AsyncIOHandle and ds_aio.AsyncIOBuilder is AsyncIOBuilder
    assert ds_builder is AsyncIOBuilder and ds_builder().load().aio_handle is AsyncIOHandle


def test_swap_refuses_bad_tensors_before_any_io(make_handle, tmp_path):
    h = make_handle()
    with pytest.raises(ValueError, match=r"tensors\[1\] must be a contiguous CPU tensor"):
        swap.swap_out([torch.zeros(3), torch.zeros(4, 4).t()], tmp_path / "a")
    assert os.listdir(tmp_path / "a") == []
    swap.swap_out([torch.zeros(8), torch.ones(4, 4)], tmp_path / "b", handle=h)
    with pytest.raises(ValueError, match="not contiguous"):
        swap.swap_in(tmp_path / "b", handle=h, out=[torch.empty(8), torch.empty(4, 4).t()])
    assert h.pending() == 0  # the read that had started was waited for
