"""``deepspeed.runtime.checkpointing`` across 2 gloo ranks: tag validation, missing ranks, per-rank files."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from torch.distributed import distributed_c10d

import deepspeed.runtime.checkpointing as ckpt
from ds_config.checkpoint import CheckpointConfig


def _state(seed: int, mode: str = "Warn", timeout_s: float = 20.0, shards: bool = False) -> ckpt.EngineState:
    torch.manual_seed(seed)
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    state = ckpt.EngineState(module=module, optimizer=optimizer,
                             checkpoint_config=CheckpointConfig(tag_validation=mode),
                             sync=ckpt.SyncOptions(timeout_s=timeout_s))
    if shards:
        state.shards = (_RankOptimizerShard(optimizer),)
    return state


class _RankOptimizerShard:
    """ZeRO-like: each data-parallel rank writes its optimizer state to its own file."""

    owns_optimizer_state = True

    def __init__(self, optimizer, fail_on_rank: int | None = None) -> None:
        self.optimizer, self.fail_on_rank = optimizer, fail_on_rank

    def model_state_extras(self):
        return {}

    def files_to_save(self, ctx):
        if ctx.parallel.dp_rank == self.fail_on_rank:
            raise OSError("No space left on device")
        return {ckpt.zero_optim_states_name(ctx.parallel.dp_rank): {"state": self.optimizer.state_dict()}}

    def load_files(self, ctx, load):
        self.optimizer.load_state_dict(load(ckpt.zero_optim_states_name(ctx.parallel.dp_rank))["state"])


def _warnings_during(call) -> list[str]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("DeepSpeed").addHandler(handler)
    try:
        call()
    finally:
        logging.getLogger("DeepSpeed").removeHandler(handler)
    return records


def _save_with_rank_tags(save_dir: str, mode: str):
    rank = dist.get_rank()
    state = _state(0, mode)
    try:
        warnings = _warnings_during(lambda: ckpt.save_checkpoint(state, save_dir, tag=f"step5_rank{rank}"))
    except ckpt.CheckpointTagError as exc:
        assert isinstance(exc, AssertionError)  # DeepSpeed asserts
        return "raised", str(exc)
    return "saved", " | ".join(warnings)


@pytest.mark.parametrize("mode", ["Warn", "Fail", "Ignore"])
def test_tag_validation_across_ranks(tmp_path, mode):
    results = run_distributed(_save_with_rank_tags, world_size=2, args=(str(tmp_path), mode), timeout=60)
    if mode == "Fail":
        assert [outcome for outcome, _ in results] == ["raised", "raised"]
        assert "'step5_rank0' on ranks [0]; 'step5_rank1' on ranks [1]" in results[1][1]
        assert not os.path.exists(tmp_path / "latest") and not os.listdir(tmp_path)  # nobody wrote
        return
    assert [outcome for outcome, _ in results] == ["saved", "saved"]
    if mode == "Warn":
        assert "[rank=1] The checkpoint tag name 'step5_rank1' is not consistent" in results[1][1]
        assert "[rank=0]" in results[0][1]
    else:
        assert results == [("saved", ""), ("saved", "")]
    assert ckpt.read_latest(tmp_path) == "step5_rank0"  # rank 0 writes the model states and 'latest'
    assert os.listdir(tmp_path / "step5_rank0") == ["mp_rank_00_model_states.pt"]


def _save_with_bad_save_dir(save_dir: str, bad_ranks: tuple[int, ...]):
    rank = dist.get_rank()
    state = _state(rank, timeout_s=30.0)
    start = time.monotonic()
    try:
        ckpt.save_checkpoint(state, None if rank in bad_ranks else save_dir)
    except ValueError as exc:
        outcome = (type(exc).__name__, str(exc), time.monotonic() - start)
    else:
        outcome = ("saved", "", 0.0)
    ckpt.save_checkpoint(state, save_dir, tag="together")  # the next collective call still meets
    return outcome


@pytest.mark.parametrize("bad_ranks", [(0, 1), (1,)])
def test_bad_save_dir_fails_every_rank_without_waiting(tmp_path, bad_ranks):
    results = run_distributed(_save_with_bad_save_dir, world_size=2, args=(str(tmp_path), bad_ranks), timeout=60)
    for rank, (kind, message, elapsed) in enumerate(results):
        assert kind == "ValueError" and elapsed < 10, (rank, message)  # not the 30 s meeting timeout
        if rank in bad_ranks:
            assert message.startswith("save_checkpoint: save_dir=None is invalid")
        else:  # the good rank learns why its peer stopped
            assert f"save_checkpoint on rank {rank}: ranks [1] were called with invalid arguments" in message
            assert "save_dir=None is invalid" in message
    assert not (tmp_path / "global_step0").exists()
    assert ckpt.read_latest(tmp_path) == "together"


def _save_on_rank_zero_only(save_dir: str):
    rank, store = dist.get_rank(), distributed_c10d._get_default_store()
    state = _state(rank, timeout_s=1.5)
    outcome = None
    if rank == 0:
        start = time.monotonic()
        try:
            ckpt.save_checkpoint(state, save_dir)
        except ckpt.CheckpointSyncError as exc:
            outcome = (str(exc), time.monotonic() - start)
        store.set("test/rank0_gave_up", "1")
    else:
        store.wait(["test/rank0_gave_up"])
    # a later save that every rank makes still meets (the failed round was rolled back)
    ckpt.save_checkpoint(state, save_dir, tag="together")
    return outcome


def test_save_on_rank_zero_only_is_detected_not_hung(tmp_path):
    results = run_distributed(_save_on_rank_zero_only, world_size=2, args=(str(tmp_path),), timeout=60)
    message, elapsed = results[0]
    assert "ranks [1] did not call save_checkpoint (tag 'global_step0') within 1.5 s (ranks [0] did)" in message
    assert "collective" in message and 1.4 < elapsed < 10
    assert results[1] is None
    assert not (tmp_path / "global_step0").exists()
    assert ckpt.read_latest(tmp_path) == "together"


def _save_and_load_shards(save_dir: str):
    rank = dist.get_rank()
    source = _state(10 + rank, shards=True)
    source.parallel = ckpt.ParallelInfo.from_environment()
    source.module(torch.ones(1, 3)).sum().backward()
    source.optimizer.step()  # momentum buffers differ per rank (different seeds)
    ckpt.save_checkpoint(source, save_dir)
    target = _state(20 + rank, shards=True)
    target.parallel = source.parallel
    path, _ = ckpt.load_checkpoint(target, save_dir)
    mine = target.optimizer.state_dict()["state"][0]["momentum_buffer"]
    return path, sorted(os.listdir(os.path.dirname(path))), torch.equal(
        mine, source.optimizer.state_dict()["state"][0]["momentum_buffer"])


def test_per_rank_shard_files(tmp_path):
    results = run_distributed(_save_and_load_shards, world_size=2, args=(str(tmp_path),), timeout=60)
    for path, files, same in results:
        assert path.endswith("global_step0/mp_rank_00_model_states.pt") and same
        assert files == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                         "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def _one_rank_fails_to_write(save_dir: str):
    rank = dist.get_rank()
    state = _state(rank)
    ckpt.save_checkpoint(state, save_dir, tag="good")
    state.shards = (_RankOptimizerShard(state.optimizer, fail_on_rank=1),)
    try:
        ckpt.save_checkpoint(state, save_dir, tag="bad")
    except ckpt.CheckpointError as exc:
        return str(exc)
    return None


def test_a_rank_failing_to_write_fails_every_rank_and_keeps_latest(tmp_path):
    results = run_distributed(_one_rank_fails_to_write, world_size=2, args=(str(tmp_path),), timeout=60)
    for message in results:
        assert message is not None and "failed on ranks [1]" in message and "No space left on device" in message
    assert ckpt.read_latest(tmp_path) == "good"


def _mismatched_calls(save_dir: str):
    state = _state(0)
    try:
        if dist.get_rank() == 0:
            ckpt.save_checkpoint(state, save_dir, tag="x")
        else:
            ckpt.load_checkpoint(state, save_dir, tag="x")
    except ckpt.CheckpointSyncError as exc:
        return str(exc)
    return None


def test_save_on_one_rank_and_load_on_another_is_reported(tmp_path):
    results = run_distributed(_mismatched_calls, world_size=2, args=(str(tmp_path),), timeout=60)
    for message in results:
        assert "different checkpoint calls" in message
        assert "load_checkpoint on ranks [1]" in message and "save_checkpoint on ranks [0]" in message


def _pipeline_stage_save(save_dir: str, parallel: bool):
    rank = dist.get_rank()
    stage = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with torch.no_grad():
        for param in stage.parameters():
            param.fill_(float(rank))  # marks the writer of each layer file (data-parallel copies agree in real use)
    config = CheckpointConfig(parallel_write={"pipeline_stage": parallel})
    layers = list(enumerate(stage))
    state = ckpt.EngineState(module=stage, checkpoint_config=config, shards=(ckpt.PipelineLayerShards(layers),),
                             sync=ckpt.SyncOptions(timeout_s=20))
    ckpt.save_checkpoint(state, save_dir)
    return sorted(os.listdir(os.path.join(save_dir, "global_step0")))


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_write_spreads_pipeline_layers_over_data_parallel_ranks(tmp_path, parallel):
    results = run_distributed(_pipeline_stage_save, world_size=2, args=(str(tmp_path), parallel), timeout=60)
    assert results[0] == results[1] == ["layer_00-model_00-model_states.pt", "layer_01-model_00-model_states.pt",
                                        "layer_02-model_00-model_states.pt", "mp_rank_00_model_states.pt"]
    writers = [torch.load(tmp_path / "global_step0" / name, weights_only=True)["weight"][0, 0].item()
               for name in results[0][:3]]
    assert writers == ([0.0, 0.0, 1.0] if parallel else [0.0, 0.0, 0.0])
