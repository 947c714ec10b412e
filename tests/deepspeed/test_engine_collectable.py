"""A dropped engine is freed with its model and optimizer states: the engine's parameter hooks (held by torch
from C++, out of the garbage collector's sight) must not keep it alive. Checked at ZeRO stages 0, 2 and 3, with
and without a training step, through weak references after ``gc.collect()``."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from _harness import run_distributed


def _dropped_engine_is_freed(stage: int, step: bool) -> tuple[bool, bool]:
    import deepspeed

    def build() -> tuple[weakref.ref, weakref.ref]:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage}}
        engine, *_ = deepspeed.initialize(model=model, config=config)
        if step:
            engine.backward(engine(torch.randn(1, 4)).sum())
            engine.step()
        return weakref.ref(engine), weakref.ref(model)

    engine, model = build()
    gc.collect()
    return engine() is None, model() is None


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("step", [False, True])
def test_dropped_engine_is_garbage_collected(stage, step):
    engine_freed, model_freed = run_distributed(_dropped_engine_is_freed, world_size=1, args=(stage, step),
                                                timeout=60)[0]
    assert engine_freed and model_freed
