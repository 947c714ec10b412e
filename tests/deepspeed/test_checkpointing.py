"""``deepspeed.runtime.checkpointing`` in one process: layout, keys, round trips, ``latest``, errors, options."""

from __future__ import annotations

import argparse
import logging
import os

import pytest
import torch
from _checkpoint_testing import assert_same_tensors

import deepspeed.runtime.checkpointing as ckpt
from deepspeed.runtime.checkpointing import atomic as _atomic
from ds_config.checkpoint import CheckpointConfig


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 2)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x))) * self.scale


def make_state(seed: int = 0, **fields) -> ckpt.EngineState:
    torch.manual_seed(seed)
    module = TinyNet()
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    config = {"train_batch_size": 4, "checkpoint": {"tag_validation": "Warn"}}
    return ckpt.EngineState(module=module, optimizer=optimizer, lr_scheduler=scheduler,
                            ds_config=config, **fields)


def train(state: ckpt.EngineState, steps: int) -> None:
    """Plain torch steps with data fixed by the step number (so a resumed run sees the same batches)."""
    for _ in range(steps):
        gen = torch.Generator().manual_seed(1000 + state.counters.global_steps)
        x, y = torch.randn(4, 4, generator=gen), torch.randn(4, 2, generator=gen)
        loss = torch.nn.functional.mse_loss(state.module(x), y)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.lr_scheduler.step()
        state.counters.global_steps += 1
        state.counters.micro_steps += 1
        state.counters.global_samples += 4



def test_layout_keys_and_latest(tmp_path):
    state = make_state()
    train(state, 3)
    tag_dir = ckpt.save_checkpoint(state, tmp_path, client_state={"epoch": 7, "note": "hi"})
    assert tag_dir == os.path.join(tmp_path, "global_step3")
    assert (tmp_path / "latest").read_text() == "global_step3"
    assert sorted(os.listdir(tag_dir)) == ["mp_rank_00_model_states.pt"]  # no temporaries left behind
    saved = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), weights_only=True)
    deepspeed_keys = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                      "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
                      "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
                      "dp_world_size", "mp_world_size", "ds_config", "ds_version"}
    assert deepspeed_keys <= saved.keys()
    assert saved["epoch"] == 7 and saved["note"] == "hi"  # client state at the top level
    assert saved["global_steps"] == 3 and saved["global_samples"] == 12 and saved["skipped_steps"] == 0
    # the config's non-default values, as DeepSpeed keeps the user's dict ("tag_validation": "Warn" is the default)
    assert saved["buffer_names"] == ["scale"] and saved["ds_config"] == {"train_batch_size": 4}
    assert saved["ds_version"] == __import__("deepspeed").__version__
    assert_same_tensors(saved["module"], state.module.state_dict())
    assert saved["lr_scheduler"]["last_epoch"] == 3


def test_round_trip_is_bitwise_and_returns_client_state(tmp_path):
    source = make_state(seed=0)
    train(source, 5)
    source.counters.skipped_steps = 2
    ckpt.save_checkpoint(source, tmp_path, tag="mine", client_state={"epoch": 3})
    target = make_state(seed=1)
    path, client = ckpt.load_checkpoint(target, tmp_path, tag="mine")
    assert path == os.path.join(tmp_path, "mine", "mp_rank_00_model_states.pt")
    assert client["epoch"] == 3 and "module" not in client and "optimizer" not in client
    assert_same_tensors(target.module.state_dict(), source.module.state_dict())
    assert_same_tensors(target.optimizer.state_dict(), source.optimizer.state_dict())
    assert target.lr_scheduler.state_dict() == source.lr_scheduler.state_dict()
    assert target.counters == source.counters
    train(source, 2)
    train(target, 2)  # the restored run continues exactly like the original
    assert_same_tensors(target.module.state_dict(), source.module.state_dict())


def test_latest_follows_the_last_save_unless_told_not_to(tmp_path):
    state = make_state()
    assert ckpt.load_checkpoint(state, tmp_path) == (None, None)  # nothing saved yet: warning, not an error
    ckpt.save_checkpoint(state, tmp_path)  # global_step0
    train(state, 2)
    ckpt.save_checkpoint(state, tmp_path)
    assert ckpt.read_latest(tmp_path) == "global_step2"
    train(state, 1)
    ckpt.save_checkpoint(state, tmp_path, save_latest=False)
    assert ckpt.read_latest(tmp_path) == "global_step2" and (tmp_path / "global_step3").is_dir()
    fresh = make_state(seed=3)
    path, _ = ckpt.load_checkpoint(fresh, tmp_path)
    assert "global_step2" in path and fresh.counters.global_steps == 2
    path, _ = ckpt.load_checkpoint(fresh, tmp_path, tag="global_step3")
    assert fresh.counters.global_steps == 3
    assert ckpt.load_checkpoint(fresh, tmp_path, tag="global_step9") == (None, None)


@pytest.fixture
def ds_log(caplog):
    """caplog for the ``DeepSpeed`` logger (which does not propagate to the root logger)."""
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def test_no_latest_logs_a_warning(tmp_path, ds_log):
    assert ckpt.load_checkpoint(make_state(), tmp_path / "nothing") == (None, None)
    assert "Unable to find latest file" in ds_log.text


@pytest.mark.parametrize(("damage", "reason"), [("truncate", "truncated"), ("garbage", "not a checkpoint file"),
                                               ("empty", "empty file")])
def test_corrupt_file_names_the_file(tmp_path, damage, reason):
    state = make_state()
    ckpt.save_checkpoint(state, tmp_path, tag="t")
    path = tmp_path / "t" / "mp_rank_00_model_states.pt"
    data = path.read_bytes()
    damaged = {"truncate": data[: len(data) // 2], "garbage": b"\x00not a torch file" * 50, "empty": b""}
    path.write_bytes(damaged[damage])
    expected = rf"mp_rank_00_model_states\.pt cannot be read: {reason}"
    with pytest.raises(ckpt.CorruptCheckpointError, match=expected) as err:
        ckpt.load_checkpoint(make_state(), tmp_path)
    assert "weights_only" not in str(err.value)  # torch's advice to load untrusted bytes is dropped


def test_unsafe_client_state_is_refused_with_the_global_named(tmp_path):
    state = make_state()
    ckpt.save_checkpoint(state, tmp_path, tag="t", client_state={"args": argparse.Namespace(lr=0.1)})
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"argparse\.Namespace"):
        ckpt.load_checkpoint(make_state(), tmp_path)
    trusted = make_state(seed=1, trusted_load=True)
    _, client = ckpt.load_checkpoint(trusted, tmp_path)
    assert client["args"].lr == 0.1


def test_exclude_frozen_parameters(tmp_path):
    state = make_state()
    state.module.embed.requires_grad_(False)
    ckpt.save_checkpoint(state, tmp_path, tag="t", exclude_frozen_parameters=True)
    saved = torch.load(tmp_path / "t" / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    assert sorted(saved) == ["head.bias", "head.weight", "scale"]
    with pytest.raises(ckpt.CheckpointError, match="do not fit the model"):
        ckpt.load_checkpoint(make_state(seed=1), tmp_path)
    target = make_state(seed=1)
    frozen_before = target.module.embed.weight.clone()
    ckpt.load_checkpoint(target, tmp_path, load_module_strict=False)
    assert torch.equal(target.module.head.weight, state.module.head.weight)
    assert torch.equal(target.module.embed.weight, frozen_before)


def test_load_module_only_leaves_optimizer_scheduler_and_counters(tmp_path):
    source = make_state()
    train(source, 4)
    ckpt.save_checkpoint(source, tmp_path, client_state={"epoch": 1})
    target = make_state(seed=1)
    optimizer_before = target.optimizer.state_dict()
    _, client = ckpt.load_checkpoint(target, tmp_path, load_module_only=True)
    assert_same_tensors(target.module.state_dict(), source.module.state_dict())
    assert target.optimizer.state_dict() == optimizer_before  # no Adam moments were loaded
    assert target.lr_scheduler.last_epoch == 0 and target.counters.global_steps == 0
    assert client["epoch"] == 1 and client["global_steps"] == 4  # what the engine did not consume comes back


def test_skipping_optimizer_and_scheduler_states(tmp_path):
    source = make_state()
    train(source, 4)
    ckpt.save_checkpoint(source, tmp_path)
    target = make_state(seed=1)
    _, client = ckpt.load_checkpoint(target, tmp_path, load_optimizer_states=False, load_lr_scheduler_states=False)
    assert target.optimizer.state_dict()["state"] == {} and target.lr_scheduler.last_epoch == 0
    assert target.counters.global_steps == 4
    assert "optimizer" in client and "lr_scheduler" in client  # handed back, as DeepSpeed does


def test_custom_load_fn_replaces_load_state_dict(tmp_path):
    source = make_state()
    ckpt.save_checkpoint(source, tmp_path)
    seen = {}

    def load_fn(src, dst):
        seen["keys"] = sorted(src)
        dst.head.weight.data.copy_(src["head.weight"] * 2)

    target = make_state(seed=1)
    embed_before = target.module.embed.weight.clone()
    ckpt.load_checkpoint(target, tmp_path, custom_load_fn=load_fn)
    assert seen["keys"] == sorted(source.module.state_dict())
    assert torch.equal(target.module.head.weight, source.module.head.weight * 2)
    assert torch.equal(target.module.embed.weight, embed_before)


def test_views_do_not_bloat_the_file(tmp_path):
    class ViewNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            flat = torch.zeros(250_000)  # 1 MB backing buffer, as a flattened ZeRO group would be
            self.weight = torch.nn.Parameter(flat[:10])

    state = ckpt.EngineState(module=ViewNet())
    ckpt.save_checkpoint(state, tmp_path, tag="t")
    assert (tmp_path / "t" / "mp_rank_00_model_states.pt").stat().st_size < 50_000


def test_save_16bit_model(tmp_path):
    module = TinyNet().to(torch.bfloat16)
    module.embed.requires_grad_(False)
    assert ckpt.save_16bit_model(module, tmp_path) is True
    weights = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert_same_tensors(weights, module.state_dict())
    ckpt.save_16bit_model(module, tmp_path, "trainable.bin", exclude_frozen_parameters=True)
    assert sorted(torch.load(tmp_path / "trainable.bin", weights_only=True)) == ["head.bias", "head.weight", "scale"]
    assert ckpt.save_16bit_model(module, tmp_path / "other", rank=1) and not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match="save_filename"):
        ckpt.save_16bit_model(module, tmp_path, "a/b.bin")


def test_save_16bit_model_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    module = TinyNet().to(torch.float16)
    ckpt.save_16bit_model(module, tmp_path, "model.safetensors")
    assert_same_tensors(safetensors_torch.load_file(tmp_path / "model.safetensors"), module.state_dict())


def test_load_universal_is_refused_clearly(tmp_path):
    state = make_state(checkpoint_config=CheckpointConfig(load_universal=True))
    ckpt.save_checkpoint(state, tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="load_universal"):
        ckpt.load_checkpoint(state, tmp_path)


@pytest.mark.parametrize("tag", ["", "a/b", "..", " x"])
def test_bad_tags_are_rejected(tmp_path, tag):
    with pytest.raises(ckpt.CheckpointTagError, match="tag"):
        ckpt.save_checkpoint(make_state(), tmp_path, tag=tag)


@pytest.mark.parametrize("save_dir", [None, "", b"", 0])
def test_bad_save_dir_is_a_value_error_naming_it(tmp_path, monkeypatch, save_dir):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"save_checkpoint: save_dir=.* is invalid; accepted: a non-empty"):
        ckpt.save_checkpoint(make_state(), save_dir)
    assert os.listdir(tmp_path) == []  # nothing written into the working directory


def test_tag_mismatch_under_fail_is_an_assertion_error():
    # DeepSpeed's tag_validation: Fail is `assert valid, msg`; ours is still a CheckpointTagError (a ValueError)
    from deepspeed.runtime.checkpointing._tags import validate_tags

    assert issubclass(ckpt.CheckpointTagError, AssertionError) and issubclass(ckpt.CheckpointTagError, ValueError)
    with pytest.raises(AssertionError, match="is not consistent across all ranks"):
        validate_tags({0: "a", 1: "b"}, "Fail", 0)


def test_failed_write_keeps_latest_and_leaves_no_temporaries(tmp_path, monkeypatch):
    state = make_state()
    ckpt.save_checkpoint(state, tmp_path)
    train(state, 1)

    def broken_save(obj, handle):
        handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(ckpt.CheckpointError, match="disk full"):
        ckpt.save_checkpoint(state, tmp_path)
    monkeypatch.undo()
    assert ckpt.read_latest(tmp_path) == "global_step0"
    assert not (tmp_path / "global_step1").exists()  # no temporaries, and no empty tag folder
    assert ckpt.load_checkpoint(make_state(seed=1), tmp_path)[0] is not None


def test_stale_temporaries_of_a_killed_writer_are_removed(tmp_path):
    target = tmp_path / "latest"
    stale = _atomic.temp_name(target)
    open(stale, "wb").close()
    _atomic.atomic_write_text(target, "global_step5")
    assert os.listdir(tmp_path) == ["latest"] and target.read_text() == "global_step5"


def test_node_local_storage_writes_from_local_rank_zero(tmp_path):
    local = CheckpointConfig(use_node_local_storage=True)
    node1_rank0 = ckpt.ParallelInfo(global_rank=2, local_rank=0, dp_rank=2, dp_world_size=4)
    ckpt.save_checkpoint(make_state(checkpoint_config=local, parallel=node1_rank0), tmp_path / "node")
    assert ckpt.read_latest(tmp_path / "node") == "global_step0"
    assert (tmp_path / "node" / "global_step0" / "mp_rank_00_model_states.pt").is_file()
    ckpt.save_checkpoint(make_state(parallel=node1_rank0), tmp_path / "shared")  # shared storage: dp rank 0 writes
    assert not (tmp_path / "shared").exists()


class RankShard:
    """A ZeRO-like extension: each rank owns its optimizer state in its own file."""

    owns_optimizer_state = True

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def model_state_extras(self):
        return {"param_shapes": [{"w": torch.Size([2, 3])}]}

    def files_to_save(self, ctx):
        name = ckpt.zero_optim_states_name(ctx.parallel.dp_rank, ctx.parallel.mp_rank)
        return {name: {"optimizer_state_dict": self.optimizer.state_dict()}}

    def load_files(self, ctx, load):
        if ctx.load_optimizer_states and not ctx.load_module_only:
            name = ckpt.zero_optim_states_name(ctx.parallel.dp_rank, ctx.parallel.mp_rank)
            self.optimizer.load_state_dict(load(name)["optimizer_state_dict"])


def test_shard_extension_owns_the_optimizer(tmp_path):
    state = make_state()
    state.shards = (RankShard(state.optimizer),)
    train(state, 2)
    ckpt.save_checkpoint(state, tmp_path)
    files = sorted(os.listdir(tmp_path / "global_step2"))
    assert files == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    saved = torch.load(tmp_path / "global_step2" / files[0], weights_only=True)
    assert saved["optimizer"] is None and saved["param_shapes"] == [{"w": torch.Size([2, 3])}]
    target = make_state(seed=1)
    target.shards = (RankShard(target.optimizer),)
    ckpt.load_checkpoint(target, tmp_path)
    assert_same_tensors(target.optimizer.state_dict(), state.optimizer.state_dict())


def test_pipeline_layer_range_spreads_layers_with_parallel_write():
    assert [list(ckpt.pipeline_layer_range(5, r, 2, parallel_write=False)) for r in range(2)] == [[0, 1, 2, 3, 4], []]
    spread = [list(ckpt.pipeline_layer_range(7, r, 3, parallel_write=True)) for r in range(3)]
    assert spread == [[0, 1, 2], [3, 4], [5, 6]]
    assert ckpt.layer_states_name(3) == "layer_03-model_00-model_states.pt"
    with pytest.raises(ValueError, match="dp_rank=3"):
        ckpt.pipeline_layer_range(4, 3, 2, parallel_write=True)


def test_tag_validation_modes_unit(ds_log):
    from deepspeed.runtime.checkpointing._tags import validate_tags

    assert validate_tags({0: "a", 1: "a"}, "Fail", 0) is True
    assert validate_tags({0: "a", 1: "b"}, "Ignore", 0) is False
    with pytest.raises(ckpt.CheckpointTagError, match=r"'a' on ranks \[0\]; 'b' on ranks \[1\]"):
        validate_tags({0: "a", 1: "b"}, "Fail", 0)
    assert validate_tags({0: "a", 1: "b"}, "Warn", 1) is False
    assert "[rank=1] The checkpoint tag name 'b' is not consistent" in ds_log.text


class FakeEngine(torch.nn.Module):
    """The DeepSpeedEngine attributes the adapter reads (the real engine passes ``self``)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        inner = make_state(seed)
        self.module, self.optimizer, self.lr_scheduler = inner.module, inner.optimizer, inner.lr_scheduler
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self.config = {"train_batch_size": 4, "checkpoint": {"tag_validation": "fail"}}
        self.global_rank, self.local_rank, self.dp_world_size, self.dp_group = 0, 0, 1, None


def test_an_engine_can_pass_itself(tmp_path):
    engine = FakeEngine(seed=0)
    adapted = ckpt.as_engine_state(engine)
    assert adapted.counters is engine and adapted.checkpoint_config.tag_validation == "Fail"
    state = ckpt.EngineState(module=engine.module, optimizer=engine.optimizer, lr_scheduler=engine.lr_scheduler,
                             counters=engine)
    train(state, 3)  # the engine's own counters advance
    ckpt.save_checkpoint(engine, tmp_path, client_state={"epoch": 2})
    assert ckpt.read_latest(tmp_path) == "global_step3"
    other = FakeEngine(seed=1)
    _, client = ckpt.load_checkpoint(other, tmp_path)
    assert (other.global_steps, other.global_samples, other.micro_steps) == (3, 12, 3) and client["epoch"] == 2
    assert_same_tensors(other.module.state_dict(), engine.module.state_dict())
    ckpt.save_16bit_model(engine, tmp_path)  # the wrapped model's keys, without a "module." prefix
    assert sorted(torch.load(tmp_path / "pytorch_model.bin", weights_only=True)) == sorted(engine.module.state_dict())
    with pytest.raises(TypeError, match="missing attributes"):
        ckpt.save_checkpoint(object(), tmp_path)


@pytest.mark.gpu
def test_cuda_round_trip_saves_cpu_tensors_and_restores_to_the_device(tmp_path):
    source = make_state(seed=0)
    source.module.cuda()
    source.optimizer = torch.optim.AdamW(source.module.parameters(), lr=0.01)
    source.module(torch.ones(2, 4, device="cuda")).sum().backward()
    source.optimizer.step()
    ckpt.save_checkpoint(source, tmp_path)
    saved = torch.load(tmp_path / "global_step0" / "mp_rank_00_model_states.pt", weights_only=True)
    assert saved["module"]["head.weight"].device.type == "cpu"  # files never need a GPU to open
    target = make_state(seed=1)
    target.module.cuda()
    target.optimizer = torch.optim.AdamW(target.module.parameters(), lr=0.01)
    ckpt.load_checkpoint(target, tmp_path)
    assert target.module.head.weight.is_cuda
    assert_same_tensors(target.module.state_dict(), source.module.state_dict())
    assert target.optimizer.state_dict()["state"][0]["exp_avg"].is_cuda


def test_sync_timeout_resolution(monkeypatch):
    from deepspeed.comm.comm import default_pg_timeout
    from deepspeed.runtime.checkpointing._sync import resolve_timeout_s

    monkeypatch.delenv("DS_CHECKPOINT_TIMEOUT", raising=False)
    assert resolve_timeout_s(ckpt.SyncOptions()) == default_pg_timeout.total_seconds()  # 30 min unless configured
    monkeypatch.setenv("DS_CHECKPOINT_TIMEOUT", "12.5")
    assert resolve_timeout_s(ckpt.SyncOptions()) == 12.5
    assert resolve_timeout_s(ckpt.SyncOptions(timeout_s=3)) == 3.0
    monkeypatch.setenv("DS_CHECKPOINT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DS_CHECKPOINT_TIMEOUT='soon'"):
        resolve_timeout_s(ckpt.SyncOptions())
    with pytest.raises(ValueError, match="positive"):
        resolve_timeout_s(ckpt.SyncOptions(timeout_s=0))


def _stage(seed: int) -> tuple[torch.nn.Sequential, list[tuple[int, torch.nn.Module]]]:
    torch.manual_seed(seed)
    stage = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    return stage, [(index, layer) for index, layer in enumerate(stage) if list(layer.parameters())]


def test_pipeline_layer_files_hold_the_weights(tmp_path):
    stage, layers = _stage(0)
    state = ckpt.EngineState(module=stage, shards=(ckpt.PipelineLayerShards(layers),))
    ckpt.save_checkpoint(state, tmp_path)
    files = sorted(os.listdir(tmp_path / "global_step0"))
    assert files == ["layer_00-model_00-model_states.pt", "layer_02-model_00-model_states.pt",
                     "mp_rank_00_model_states.pt"]
    assert torch.load(tmp_path / "global_step0" / files[2], weights_only=True)["module"] is None
    assert_same_tensors(torch.load(tmp_path / "global_step0" / files[1], weights_only=True),
                        stage[2].state_dict())
    other, other_layers = _stage(1)
    ckpt.load_checkpoint(ckpt.EngineState(module=other, shards=(ckpt.PipelineLayerShards(other_layers),)), tmp_path)
    assert_same_tensors(other.state_dict(), stage.state_dict())
    wrong = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    wrong_state = ckpt.EngineState(module=wrong, shards=(ckpt.PipelineLayerShards([(0, wrong[0]), (2, wrong[2])]),))
    with pytest.raises(ckpt.CheckpointError, match="layer_00-model_00-model_states.pt.*layer 0"):
        ckpt.load_checkpoint(wrong_state, tmp_path)
    with pytest.raises(ValueError, match="distinct"):
        ckpt.PipelineLayerShards([(1, stage[0]), (1, stage[2])])
