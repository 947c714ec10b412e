"""Misusing ``no_sync`` / ``coalesce_grad_reduction`` raises what DeepSpeed raises (an ``AssertionError`` naming
``no_sync`` or the nesting; ours is also a ``RuntimeError``), pipeline engines refuse ``coalesce_grad_reduction``,
and ``_is_gradient_accumulation_boundary`` is the boundary override under DeepSpeed's attribute name."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed


def _engine(stage: int):
    import deepspeed

    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}
    return deepspeed.initialize(model=model, config=config)[0]


def _caught(fn) -> tuple[list[str], str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reports what was raised
        return [c.__name__ for c in (AssertionError, RuntimeError, NotImplementedError) if isinstance(exc, c)], \
            str(exc)
    return [], ""


def _body(stage: int) -> dict:
    engine = _engine(stage)
    out = {}

    def step_inside():
        with engine.coalesce_grad_reduction():
            engine.backward(engine(torch.randn(2, 4)).sum())
            engine.step()
    out["step"] = _caught(step_inside)
    engine.zero_grad()

    def no_sync_inside():
        with engine.coalesce_grad_reduction(), engine.no_sync():
            pass
    out["no_sync_inside"] = _caught(no_sync_inside)

    def coalesce_inside():
        with engine.no_sync(), engine.coalesce_grad_reduction():
            pass
    out["coalesce_inside"] = _caught(coalesce_inside)

    engine.set_gradient_accumulation_boundary(False)
    out["override"] = engine._is_gradient_accumulation_boundary
    engine._is_gradient_accumulation_boundary = None  # DeepSpeed's attribute writes the override too
    out["counter"] = engine.is_gradient_accumulation_boundary()
    engine.pipeline_parallelism = True

    def pipelined():
        with engine.coalesce_grad_reduction():
            pass
    out["pipeline"] = _caught(pipelined)
    engine.pipeline_parallelism = False
    before = engine.module[0].weight.detach().clone()
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    out["trains"] = not torch.equal(before, engine.module[0].weight)
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_context_misuse_raises_like_deepspeed(stage):
    (r,) = run_distributed(_body, world_size=1, args=(stage,), timeout=120)
    assert r["step"][0] == ["AssertionError", "RuntimeError"] and "no_sync" in r["step"][1]
    if stage == 1:
        assert r["no_sync_inside"][0] == ["AssertionError", "RuntimeError"] and "no_sync" in r["no_sync_inside"][1]
        assert r["coalesce_inside"][0] == ["AssertionError", "RuntimeError"] and "nested" in r["coalesce_inside"][1]
    else:  # stage 2 refuses no_sync itself, with DeepSpeed's message
        assert "incompatible with gradient partitioning" in r["no_sync_inside"][1]
    assert r["override"] is False and r["counter"] is True
    assert "NotImplementedError" in r["pipeline"][0] and "pipeline parallelism" in r["pipeline"][1]
    assert r["trains"]
