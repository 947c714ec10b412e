"""Engine behaviour DeepSpeed's own unit tests check: ``no_sync``'s assertions (reentry, ``step()`` inside it,
partitioned gradients) with DeepSpeed's wording, and ``engine.tput_timer`` (DeepSpeed's ``ThroughputTimer``)
counting micro and optimizer steps through forward/step."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed

ADAM = {"type": "Adam", "params": {"lr": 0.01}}


def _engine(stage: int = 0, gas: int = 1):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "optimizer": ADAM,
              "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    return deepspeed.initialize(model=model, config=config)[0]


def _message(block) -> str:
    with pytest.raises(AssertionError) as info:
        block()
    return str(info.value)


def _no_sync_body() -> dict:
    engine = _engine()
    out = {}
    with engine.no_sync():
        engine.backward(engine(torch.randn(2, 4)).sum())
        out["step"] = _message(engine.step)

        def reenter():
            with engine.no_sync():
                pass
        out["reentry"] = _message(reenter)
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()  # outside the block the step is legal again
    out["steps"] = engine.global_steps

    def stage2():
        with _engine(stage=2).no_sync():
            pass
    out["stage2"] = _message(stage2)
    return out


def test_no_sync_asserts_like_deepspeed():
    out = run_distributed(_no_sync_body, world_size=1, timeout=120)[0]
    assert "It is illegal to call Engine.step() inside no_sync context manager" in out["step"]
    assert "no_sync context manager reentry is unsupported" in out["reentry"]
    assert "no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage 2" in out["stage2"]
    assert out["steps"] == 1


def _tput_body() -> dict:
    engine = _engine(gas=3)
    timer = engine.tput_timer
    first = (timer.batch_size, timer.initialized, timer.start_step, timer.micro_step_count)
    for _ in range(12):  # 4 optimizer steps of 3 micro steps
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
    return {"first": first, "micro": timer.micro_step_count, "global": timer.global_step_count,
            "timed": timer.total_elapsed_time > 0, "started": timer.started}


def test_tput_timer_counts_micro_and_optimizer_steps():
    out = run_distributed(_tput_body, world_size=1, timeout=120)[0]
    assert out["first"] == (6, False, 2, 0)  # batch = micro 2 x gas 3; nothing counted before a forward
    assert (out["micro"], out["global"], out["started"]) == (12, 4, False)
    assert out["timed"]  # steps after start_step (2) are timed
