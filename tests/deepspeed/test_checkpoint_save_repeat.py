"""Save-speed measures that must not change what a checkpoint holds (``docs/checkpoint-speed.md``).

- Checkpoint files are written without the zip CRC32s: torch never checks them, so the files load as before, in
  torch's plain and mapped reads, and the process-wide option is restored after each save, even a failed one.
- The background fsyncs run on threads started once per process; a forked child starts its own.
- Concurrency proven by repetition: a 2-rank ZeRO-2 / ZeRO-3 job (uneven partitions) saves the same state three
  times; the three tags' files are byte-identical, each loads back bitwise, and ``zero_to_fp32`` rebuilds the
  same fp32 weights from each.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import threading
import zipfile

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

from deepspeed.runtime.checkpointing import atomic
from deepspeed.runtime.checkpointing.serialize import load_file, save_without_crc, stage_file


def _flip_data_byte(path: str) -> None:
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 64)
    with open(path, "rb") as handle:  # the local header's name and extra lengths locate the data
        handle.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(handle.read(2), "little") for _ in range(2))
    offset = info.header_offset + 30 + name_len + extra_len + 16
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("mmap", [False, True])
def test_torch_load_does_not_check_the_zip_crc(tmp_path, mmap):
    """The premise of writing without CRC32s: torch.load reads a file whose data byte was flipped without a word,
    so the CRCs never protected a load (if a torch release starts checking them, revisit save_without_crc)."""
    path = str(tmp_path / "f.pt")
    torch.save({"w": torch.arange(256.0)}, path)
    _flip_data_byte(path)
    loaded = torch.load(path, weights_only=True, mmap=mmap)["w"]
    assert not torch.equal(loaded, torch.arange(256.0))


@pytest.mark.parametrize("mmap", [False, True])
def test_checkpoint_files_have_no_crc_and_load_bitwise(tmp_path, mmap):
    obj = {"w": torch.randn(1000), "step": 3, "nested": {"b": torch.arange(7, dtype=torch.int64)}}
    path = tmp_path / "f.pt"
    atomic.commit(stage_file(obj, path), str(path))
    with zipfile.ZipFile(path) as archive:
        assert [i.CRC for i in archive.infolist()] == [0] * len(archive.infolist())
    back = load_file(path, mmap=mmap)
    assert back["step"] == 3 and torch.equal(back["w"], obj["w"]) and torch.equal(back["nested"]["b"],
                                                                                    obj["nested"]["b"])


@pytest.mark.parametrize("before", [True, False])
def test_the_crc_option_is_restored_even_when_the_save_fails(before):
    saved = torch.serialization.get_crc32_options()
    try:
        torch.serialization.set_crc32_options(before)
        save_without_crc({"w": torch.ones(3)}, io.BytesIO())
        assert torch.serialization.get_crc32_options() is before
        with pytest.raises(Exception):  # noqa: B017 - whatever torch raises for an unpicklable object
            save_without_crc({"f": threading.Lock()}, io.BytesIO())
        assert torch.serialization.get_crc32_options() is before
    finally:
        torch.serialization.set_crc32_options(saved)


def _fsync_threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.name.startswith("ds-ckpt-fsync")}


def test_fsync_threads_are_started_once(tmp_path):
    seen = []
    for i in range(4):
        with atomic.Syncer() as syncer:
            for j in range(6):
                atomic.stage_write(tmp_path / f"f{i}{j}", lambda h: h.write(b"x"), syncer)
        seen.append(_fsync_threads())
    # the pool starts a thread only when none is idle, up to its size, and keeps them: saves reuse the threads
    # earlier saves started (never a fresh set per save), and the count never passes the pool's size
    assert seen[0]
    assert all(earlier <= later for earlier, later in zip(seen, seen[1:], strict=False))
    assert len(seen[-1]) <= atomic._FSYNC_WORKERS


def _child_syncs(path: str, queue) -> None:
    with atomic.Syncer() as syncer:
        tmp = atomic.stage_write(path, lambda h: h.write(b"child"), syncer)
    atomic.commit(tmp, path)
    queue.put(open(path, "rb").read())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_gets_fsync_threads_of_its_own(tmp_path):
    with atomic.Syncer() as syncer:  # the parent's pool exists before the fork
        atomic.stage_write(tmp_path / "parent", lambda h: h.write(b"p"), syncer)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_syncs, args=(str(tmp_path / "c"), queue))
    child.start()
    child.join(30)
    assert child.exitcode == 0 and queue.get(timeout=5) == b"child"


class _Uneven(torch.nn.Module):
    """Odd sizes, so ZeRO pads the partitions (stage 2: the flat group; stage 3: each parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(13, 31)
        self.b = torch.nn.Linear(31, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _save_three_times(root: str, stage: int) -> dict:
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}
    engine = deepspeed.initialize(model=_Uneven(), config=config)[0]
    for step in range(2):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        engine.backward(engine(torch.randn(4, 13, generator=gen)).square().mean())
        engine.step()
    tags = ["t0", "t1", "t2"]
    for tag in tags:
        engine.save_checkpoint(root, tag=tag)
    masters = [g.master.detach().clone() for g in engine.optimizer.groups]
    for tag in reversed(tags):  # each tag restores the same masters, bitwise
        for group in engine.optimizer.groups:
            group.master.data.add_(1.0)
        engine.load_checkpoint(root, tag=tag)
        assert all(torch.equal(g.master, m) for g, m in zip(engine.optimizer.groups, masters, strict=True)), tag
    dist.barrier()
    if dist.get_rank() != 0:
        return {}
    files = {tag: {name: open(os.path.join(root, tag, name), "rb").read() for name in os.listdir(os.path.join(root,
                                                                                                            tag))}
             for tag in tags}
    weights = {tag: get_fp32_state_dict_from_zero_checkpoint(root, tag=tag) for tag in tags}
    return {"files": files, "weights": weights}


@pytest.mark.parametrize("stage", [2, 3])
def test_three_saves_of_one_state_are_identical(tmp_path, stage):
    result = run_distributed(_save_three_times, world_size=2, args=(str(tmp_path), stage), timeout=120)[0]
    files, weights = result["files"], result["weights"]
    assert len(files["t0"]) == (3 if stage == 2 else 4)
    for tag in ("t1", "t2"):
        assert files[tag].keys() == files["t0"].keys()
        for name, content in files["t0"].items():
            assert files[tag][name] == content, (tag, name)
        assert weights[tag].keys() == weights["t0"].keys()
        assert all(torch.equal(weights[tag][k], v) for k, v in weights["t0"].items())
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
