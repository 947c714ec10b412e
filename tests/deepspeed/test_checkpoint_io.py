"""How checkpoint files are written and read, in one process: background fsyncs, early writeback, views of one
flat buffer written once, the config's non-default values, mapped reads copied out, and an unchanged
``zero_to_fp32.py`` left alone."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import torch

import deepspeed.runtime.checkpointing as ckpt
from deepspeed.runtime.checkpointing import atomic
from deepspeed.runtime.checkpointing.serialize import compact_for_save, load_file, materialize
from ds_config import load_config
from ds_zero.checkpoint import saved_config


def test_background_fsync_makes_every_file_durable_before_wait_returns(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_size), real(fd)))
    with atomic.Syncer() as syncer:
        temps = [atomic.stage_write(tmp_path / f"f{i}", lambda h, i=i: h.write(b"x" * (i + 1)), syncer)
                 for i in range(3)]
    assert sorted(synced) == [1, 2, 3]  # each file's own descriptor, fsynced with all its bytes
    assert [os.path.getsize(t) for t in temps] == [1, 2, 3]


def test_a_failed_background_fsync_is_raised_naming_the_file(tmp_path, monkeypatch):
    def failing(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError) as info, atomic.Syncer() as syncer:
        atomic.stage_write(tmp_path / "model.pt", lambda h: h.write(b"abc"), syncer)
    assert info.value.errno == errno.EIO and info.value.checkpoint_path == str(tmp_path / "model.pt")


def test_a_save_whose_fsync_fails_commits_nothing(tmp_path, monkeypatch):
    state = _state()
    ckpt.save_checkpoint(state, tmp_path, tag="good")
    real = os.fsync

    def failing(fd):  # the checkpoint files' data only: directories and the small 'latest' still sync
        if stat.S_ISREG(os.fstat(fd).st_mode) and os.fstat(fd).st_size > 1000:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(ckpt.CheckpointRankError, match="EIO"):
        ckpt.save_checkpoint(state, tmp_path, tag="bad")
    assert (tmp_path / "latest").read_text() == "good"
    assert not (tmp_path / "bad").exists()
    assert not [n for n in os.listdir(tmp_path / "good") if ".tmp-" in n]


def test_large_files_start_their_writeback_while_being_written(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(atomic, "_start_writeback", lambda fd, start, count, flags: calls.append((start, count)))
    payload = os.urandom(3 * atomic._WRITEBACK_EVERY + 10)
    chunk = atomic._WRITEBACK_EVERY // 2
    tmp = atomic.stage_write(tmp_path / "big", lambda h: [h.write(payload[i:i + chunk])
                                                           for i in range(0, len(payload), chunk)])
    with open(tmp, "rb") as handle:
        assert handle.read() == payload
    assert calls == [(i * atomic._WRITEBACK_EVERY, atomic._WRITEBACK_EVERY) for i in range(3)]


def test_views_covering_one_flat_buffer_are_written_once_without_copies(tmp_path):
    flat = torch.arange(100.0)
    views = {"a": flat[:60].view(6, 10), "b": flat[60:]}
    kept = compact_for_save(views, share_views=True)
    assert all(kept[k].data_ptr() == views[k].data_ptr() for k in views)
    part = compact_for_save({"a": flat[:10]}, share_views=True)["a"]  # most of the buffer would be written for it
    assert part.data_ptr() != flat.data_ptr() and part.untyped_storage().nbytes() == 40
    cloned = compact_for_save(views)  # default: every view gets storage of its own (save_16bit_model)
    assert all(cloned[k].data_ptr() != views[k].data_ptr() for k in views)
    torch.save(kept, tmp_path / "kept.pt")
    back = torch.load(tmp_path / "kept.pt", weights_only=True)
    assert torch.equal(back["a"], views["a"]) and torch.equal(back["b"], views["b"])
    assert back["a"].untyped_storage().data_ptr() == back["b"].untyped_storage().data_ptr()


def test_saved_config_keeps_what_differs_from_the_defaults():
    user = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.95]}}, "fp16": {"enabled": True},
            "checkpoint": {"tag_validation": "Warn"}}
    full = load_config(user, world_size=2).to_dict()
    saved = saved_config(full)
    assert load_config(saved, world_size=2).to_dict() == full
    assert saved["optimizer"]["params"] == {"lr": 0.001, "betas": [0.9, 0.95]}  # unset options (nulls) left out
    assert saved["zero_optimization"] == {"stage": 2} and "checkpoint" not in saved  # Warn is the default
    assert len(repr(saved)) < len(repr(full)) // 10


def test_mapped_reads_are_copied_out_by_materialize(tmp_path):
    torch.save({"w": torch.arange(8.0), "nested": [torch.ones(3)]}, tmp_path / "zip.pt")
    torch.save({"w": torch.arange(8.0)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    mapped = load_file(tmp_path / "zip.pt", mmap=True)
    own = materialize(mapped)
    with open(tmp_path / "zip.pt", "r+b") as handle:  # in place: the private mapping shows the new bytes
        handle.write(b"\0" * os.path.getsize(tmp_path / "zip.pt"))
    assert torch.equal(own["w"], torch.arange(8.0)) and torch.equal(own["nested"][0], torch.ones(3))
    assert torch.equal(load_file(tmp_path / "legacy.pt", mmap=True)["w"], torch.arange(8.0))  # read as usual


def test_an_unchanged_copied_script_is_not_rewritten(tmp_path):
    script = tmp_path / "tool.py"
    script.write_text("print('v1')\n")

    class Copies:
        owns_optimizer_state = False

        def model_state_extras(self):
            return {}

        def files_to_save(self, ctx):
            return {}

        def files_to_copy(self, ctx):
            return {"tool.py": str(script)}

        def load_files(self, ctx, load):
            pass

    save_dir = tmp_path / "save"
    state = _state(shards=(Copies(),))
    ckpt.save_checkpoint(state, save_dir, tag="a")
    first = os.stat(save_dir / "tool.py").st_ino
    ckpt.save_checkpoint(state, save_dir, tag="b")
    assert os.stat(save_dir / "tool.py").st_ino == first  # same bytes: left as it was
    script.write_text("print('v2')\n")
    ckpt.save_checkpoint(state, save_dir, tag="c")
    assert (save_dir / "tool.py").read_text() == "print('v2')\n"


def _state(**fields) -> ckpt.EngineState:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    return ckpt.EngineState(module=module, optimizer=optimizer, ds_config={"train_batch_size": 2}, **fields)
