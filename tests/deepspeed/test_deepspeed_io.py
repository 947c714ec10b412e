"""``deepspeed.io``: ``torch.save`` through ``FastFileWriter`` (pinned buffer + async aio writes) gives the same
bytes as ``torch.save`` to memory, on every repetition, with one or two buffer slots; descriptors never outlive
``close``; parallel writers' shares make the whole storage stream."""

from __future__ import annotations

import io
import os
import random

import pytest
import torch

from deepspeed.io import FastFileWriter, FastFileWriterConfig, MockFileWriter, PyFileWriter
from deepspeed.ops.op_builder import AsyncIOBuilder


@pytest.fixture(scope="module")
def handle():
    h = AsyncIOBuilder().load().aio_handle(block_size=8192, queue_depth=4, single_submit=False, overlap_events=True,
                                           intra_op_parallelism=2)
    yield h
    h.close()


def _reference(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _deleted_fds(folder) -> int:
    n = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
        n += target.startswith(str(folder)) and target.endswith("(deleted)")
    return n


@pytest.mark.parametrize("double_buffer", [True, False], ids=["double", "single"])
def test_save_matches_in_memory_bytes_repeatedly(handle, tmp_path, double_buffer):
    rng = random.Random(11)
    pinned = handle.new_cpu_locked_tensor(4 * handle.get_alignment() * 2, torch.uint8)  # small: many drains
    try:
        for rep in range(4):
            n = rng.randrange(1, 40_000)
            obj = {"w": torch.randn(n, generator=torch.Generator().manual_seed(rep)), "step": rep,
                   "ids": torch.arange(rng.randrange(1, 3000), dtype=torch.int32)}
            path = tmp_path / f"ckpt_{rep}.pt"
            path.write_bytes(b"\xff" * 300_000)  # an older, longer file must not leave its tail behind
            with FastFileWriter(str(path), FastFileWriterConfig(handle, pinned, double_buffer=double_buffer)) as w:
                torch.save(obj, w)
            assert path.read_bytes() == _reference(obj), f"repetition {rep}"
            back = torch.load(path, weights_only=True)
            assert torch.equal(back["w"], obj["w"]) and back["step"] == rep
            assert w._stats["aio_bytes"] == w._stats["bytes"] == path.stat().st_size
    finally:
        handle.free_cpu_locked_tensor(pinned)


def test_close_releases_the_descriptor_and_is_idempotent(handle, tmp_path):
    pinned = handle.new_cpu_locked_tensor(2 * handle.get_alignment(), torch.uint8)
    before = _deleted_fds(tmp_path)
    for i in range(5):
        path = tmp_path / f"rot_{i}.pt"
        w = FastFileWriter(str(path), FastFileWriterConfig(dnvme_handle=handle, pinned_tensor=pinned))
        torch.save(torch.zeros(10_000, dtype=torch.uint8), w)
        w.close()
        w.close()
        assert w.fileno() == -1 and w._stats["close"] == 2
        os.unlink(path)
    assert _deleted_fds(tmp_path) == before
    with pytest.raises(ValueError, match="is closed"):
        w.write(b"late")
    handle.free_cpu_locked_tensor(pinned)


def test_parallel_writers_shares_make_the_whole_stream(handle, tmp_path):
    storages = [(t.untyped_storage(), t.dtype) for t in (torch.randn(333), torch.arange(7, dtype=torch.int64),
                                                         torch.ones(5, dtype=torch.bfloat16))]
    pinned = handle.new_cpu_locked_tensor(4 * handle.get_alignment(), torch.uint8)
    whole = tmp_path / "whole.bin"
    with FastFileWriter(str(whole), FastFileWriterConfig(handle, pinned)) as w:
        total = w.save_torch_storage_object_list(storages, save_size=True)
    expected = b"".join(torch.tensor([s.nbytes() // torch._utils._element_size(d)]).numpy().tobytes()
                        + bytes(s) for s, d in storages)
    assert whole.read_bytes() == expected and total == len(expected)
    shares = []
    for rank in range(3):
        part = tmp_path / f"part{rank}.bin"
        with FastFileWriter(str(part), FastFileWriterConfig(handle, pinned, num_parallel_writers=3,
                                                            writer_rank=rank)) as w:
            w.save_torch_storage_object_list(storages, save_size=True)
        shares.append(part.read_bytes())
    assert b"".join(shares) == expected and {len(s) for s in shares} <= {len(expected) // 3, len(expected) // 3 + 1}
    handle.free_cpu_locked_tensor(pinned)


def test_bad_configuration_is_named(handle, tmp_path):
    path = str(tmp_path / "x.pt")
    align = handle.get_alignment()
    with pytest.raises(ValueError, match=f"multiple of {2 * align}"):
        FastFileWriter(path, FastFileWriterConfig(handle, torch.empty(align, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="1-D uint8 CPU tensor"):
        FastFileWriter(path, FastFileWriterConfig(handle, torch.empty(2 * align, dtype=torch.float32)))
    with pytest.raises(ValueError, match=r"writer_rank must be an int in \[0, 2\)"):
        FastFileWriter(path, FastFileWriterConfig(handle, torch.empty(2 * align, dtype=torch.uint8),
                                                  num_parallel_writers=2, writer_rank=2))
    with pytest.raises(TypeError, match="dnvme_handle must be an aio handle"):
        FastFileWriter(path, FastFileWriterConfig(object(), torch.empty(2 * align, dtype=torch.uint8)))


def test_py_and_mock_writers(tmp_path):
    obj = {"t": torch.randn(100)}
    py = PyFileWriter(str(tmp_path / "py.pt"))
    torch.save(obj, py)
    py.close()
    assert (tmp_path / "py.pt").read_bytes() == _reference(obj) and py._stats["bytes"] == len(_reference(obj))
    mock = MockFileWriter(str(tmp_path / "mock.pt"))
    torch.save(obj, mock)
    mock.close()
    assert (tmp_path / "mock.pt").stat().st_size == 0 and mock._stats["bytes"] == len(_reference(obj))
