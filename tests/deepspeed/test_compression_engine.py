"""compression_training through deepspeed.initialize: the engine prepares the model, steps the compression
scheduler after every optimizer step (schedule offsets and the bit schedule follow the engine's steps), the
optimizer-step quantization mode with bf16 masters, data-parallel ranks agreeing on learned masks, and the
configurations it refuses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

from ds_config import ConfigError

ADAM = {"type": "Adam", "params": {"lr": 1e-2}}


@pytest.fixture(autouse=True)
def _single_process_group(monkeypatch):
    """The in-process tests train a world of 1 on a free port (the default 29500 may be taken by another job on
    the machine); the group deepspeed.initialize creates goes with the test."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(probe.getsockname()[1]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def config(compression: dict, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": ADAM, "steps_per_print": 1000,
            "compression_training": compression, **extra}


TRAINING = {
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "schedule_offset": 2},
        "different_groups": {"wq": {"params": {"start_bits": 8, "target_bits": 5, "quantization_period": 1},
                                    "modules": ["2"]}}},
    "sparse_pruning": {
        "shared_parameters": {"enabled": True, "method": "topk", "schedule_offset": 1},
        "different_groups": {"sp": {"params": {"dense_ratio": 0.25}, "modules": ["^2$"]}}},
    "row_pruning": {
        "shared_parameters": {"enabled": True, "method": "topk", "schedule_offset": 3},
        "different_groups": {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["^0$"], "related_modules": [["^2$"]]}}},
}


def test_engine_steps_the_schedule_and_trains_the_masks():
    import deepspeed
    from deepspeed.compression import redundancy_clean

    engine, *_ = deepspeed.initialize(model=mlp(), config=config(TRAINING))
    first, last = engine.module[0], engine.module[2]
    scores0 = first.row_mask_scores.detach().clone()
    gen = torch.Generator().manual_seed(3)
    history = []
    for _ in range(6):
        x = torch.randn(4, 8, generator=gen)
        history.append((last.sparse_pruning_enabled, first.row_pruning_enabled, last.weight_quantization_enabled))
        loss = engine(x).pow(2).mean()
        assert torch.isfinite(loss)
        engine.backward(loss)
        engine.step()
    # offsets 1 (sparse), 3 (row), 2 (quantization), counted in optimizer steps
    assert history == [(False, False, False), (True, False, False), (True, False, True), (True, True, True),
                       (True, True, True), (True, True, True)]
    assert engine.compression_scheduler.training_steps == 6
    assert last.weight_quantize_bits == 5  # 8 at step 2, one bit less per step, floored at target 5
    assert int((last.compressed_weight() != 0).sum()) <= math.ceil(0.25 * 64)
    assert not torch.equal(first.row_mask_scores.detach(), scores0)  # the scores are trained parameters
    x = torch.randn(3, 8)
    with torch.no_grad():
        masked = engine.module(x)
        redundancy_clean(engine, config(TRAINING))
        cleaned = engine.module(x)
    assert first.weight.shape == (8, 8) and last.weight.shape == (4, 8)
    assert int((last.weight != 0).sum()) <= math.ceil(0.25 * 64)
    torch.testing.assert_close(cleaned, masked)


def test_resumed_run_continues_the_schedule(tmp_path):
    import deepspeed

    engine, *_ = deepspeed.initialize(model=mlp(), config=config(TRAINING))
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
    engine.save_checkpoint(str(tmp_path))
    resumed, *_ = deepspeed.initialize(model=mlp(seed=5), config=config(TRAINING))
    assert not resumed.module[0].row_pruning_enabled  # a fresh engine: step 0
    resumed.load_checkpoint(str(tmp_path))
    x = torch.randn(4, 8)
    resumed(x)  # the first forward after loading applies step 3: row pruning (offset 3) on, 7 bits
    assert resumed.compression_scheduler.training_steps == 3
    assert resumed.module[0].row_pruning_enabled and resumed.module[2].weight_quantize_bits == 7
    torch.testing.assert_close(resumed.module[0].row_mask_scores, engine.module[0].row_mask_scores)
    with torch.no_grad():
        torch.testing.assert_close(resumed(x), engine(x))
    resumed.backward(resumed(x).pow(2).mean())
    resumed.step()
    assert resumed.compression_scheduler.training_steps == 4 and resumed.module[2].weight_quantize_bits == 6


def test_optimizer_step_quantization_with_bf16_masters():
    import deepspeed

    wq = {"shared_parameters": {"enabled": True, "quantize_weight_in_forward": False, "quantize_groups": 2},
          "different_groups": {"wq": {"params": {"start_bits": 6, "target_bits": 4, "quantization_period": 2},
                                      "modules": ["0", "2"]}}}
    engine, *_ = deepspeed.initialize(model=mlp(), config=config({"weight_quantization": wq}, bf16={"enabled": True},
                                                                  zero_optimization={"stage": 1}))
    layer = engine.module[0]
    bits = []
    for _ in range(4):
        engine.backward(engine(torch.randn(4, 8).bfloat16()).float().pow(2).mean())
        engine.step()
        bits.append(layer.weight_quantize_bits)
        assert max(torch.unique(g).numel() for g in layer.weight.detach().reshape(2, -1)) <= 2 ** bits[-1]
    assert bits == [6, 5, 5, 4]


@pytest.mark.parametrize("extra, key", [
    ({}, "compression_training.weight_quantization.shared_parameters.quantize_weight_in_forward"),
    ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, "zero_optimization.stage"),
])
def test_refused_combinations_name_their_key(extra, key):
    import deepspeed

    wq = {"shared_parameters": {"enabled": True, "quantize_weight_in_forward": False},
          "different_groups": {"wq": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["0"]}}}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        deepspeed.initialize(model=mlp(), config=config({"weight_quantization": wq}, **extra))


def test_engine_without_compression_has_no_scheduler():
    import deepspeed

    engine, *_ = deepspeed.initialize(model=mlp(), config=config({}))
    assert engine.compression_scheduler is None
    assert type(engine.module[0]) is torch.nn.Linear


def _two_ranks() -> dict:
    import deepspeed

    rank = dist.get_rank()
    compression = {"row_pruning": TRAINING["row_pruning"] | {"shared_parameters": {"enabled": True, "method": "topk"}}}
    engine, *_ = deepspeed.initialize(model=mlp(seed=rank), config=config(compression))  # ranks start different
    for step in range(3):
        engine.backward(engine(torch.randn(4, 8) + rank + step).pow(2).mean())
        engine.step()
    return {"mask": engine.module[0].get_mask("row").detach().reshape(-1).tolist(),
            "scores": engine.module[0].row_mask_scores.detach().reshape(-1).tolist()}


def test_data_parallel_ranks_agree_on_learned_masks():
    results = run_distributed(_two_ranks, world_size=2, timeout=120)
    assert results[0] == results[1]
    assert sum(results[0]["mask"]) == 8
