"""Gradient clipping and the overflow verdict span model-parallel ranks (DeepSpeed's ``get_grad_norm`` rule),
through ``deepspeed.initialize`` on gloo ranks with a ``PipelineParallelGrid`` as the mpu.

Each rank runs the whole model forward and backward (so its gradients are the whole model's) but trains only
its stage's parameters (the others are frozen), as a pipeline stage would hold them. A weight tied across the
two stages is trained on both, its stage-1 copy marked ``ds_pipe_replicated`` (counted once). The clipped update
of every stage must equal the single-process update of the whole model, and inf on one rank must make every
rank skip. The stage-builder seam hands the grid to the builders (``StageInputs.mpu``) explicitly, so these tests
check the optimizer wrappers whatever the engine forwards.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

IN, HID, BATCH, LR, CLIP = 4, 8, 3, 0.1, 0.05
STAGES = (("w", "b1"), ("mid", "b2", "w"))  # stage 1 holds a copy of the tied weight w
BASE = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
        "gradient_clipping": CLIP, "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_allow_untested_optimizer": True}
PRECISION = {"fp32": {}, "bf16": {"bf16": {"enabled": True, "check_grad_overflow": True}},
             "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}


class Tied(torch.nn.Module):
    """``w`` projects in and (transposed) out: a tied weight whose gradient has two contributions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(HID, IN) * 0.5)
        self.b1 = torch.nn.Parameter(torch.randn(HID) * 0.1)
        self.mid = torch.nn.Parameter(torch.randn(HID, HID) * 0.3)
        self.b2 = torch.nn.Parameter(torch.randn(HID) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w.t() + self.b1)
        return torch.tanh(h @ self.mid.t() + self.b2) @ self.w


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, IN, generator=g) * 2, torch.randn(BATCH, IN, generator=g)


def _initialize(model: torch.nn.Module, config: dict, mpu=None):
    """``deepspeed.initialize`` whose stage builder receives ``mpu`` in ``StageInputs.mpu``."""
    import deepspeed
    from deepspeed.runtime.engine import _stages as _setup

    stage = config.get("zero_optimization", {}).get("stage", 0)
    original = _setup._stage_builder(stage)
    _setup.register_zero_stage(stage, lambda inputs: original(dataclasses.replace(inputs, mpu=mpu)))
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    finally:
        _setup.register_zero_stage(stage, original)
    return engine


def _inf_first(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = math.inf
    return grad


def _train_step(engine, poison: str | None = None) -> dict:
    """One step; ``poison`` names a parameter whose gradient gets an inf before the step."""
    from deepspeed.utils import safe_get_full_fp32_param

    x, target = _batch()
    dtype = next(engine.module.parameters()).dtype
    if poison is not None:  # before the engine's gradient hooks see it (ZeRO reduces it during backward)
        getattr(engine.module, poison).register_hook(_inf_first)
    loss = ((engine(x.to(dtype)).float() - target) ** 2).mean()
    engine.backward(loss)
    engine.step()
    weights = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            master = safe_get_full_fp32_param(p)  # collective under ZeRO (same order on the data-parallel group)
            weights[name] = (p.detach().float() if master is None else master).clone()
    return {"weights": weights, "norm": engine.get_global_grad_norm(), "skipped": engine.skipped_steps,
            "scale": engine.optimizer.loss_scale}


def _stage_body(precision: str, zero: int, dp: int, poison: tuple[int, str] | None = None) -> dict:
    from ds_pipe import PipeDataParallelTopology, PipelineParallelGrid

    grid = PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=dp))
    stage = grid.get_stage_id()
    model = Tied()
    for name, p in model.named_parameters():
        p.requires_grad_(name in STAGES[stage])
    model.w.ds_pipe_replicated = stage == 1  # PipelineModule marks a tied weight's non-owner copies so
    config = {**BASE, **PRECISION[precision], "zero_optimization": {"stage": zero}}
    engine = _initialize(model, config, grid)
    hit = poison is not None and dist.get_rank() == poison[0]
    return {"stage": stage, **_train_step(engine, poison[1] if hit else None)}


def _whole_body(precision: str) -> dict:
    """The reference: the whole model trained by one rank, no mpu."""
    engine = _initialize(Tied(), {**BASE, **PRECISION[precision]})
    return _train_step(engine)


def _torch_reference() -> tuple[dict[str, torch.Tensor], float]:
    model = Tied()
    x, target = _batch()
    ((model(x) - target) ** 2).mean().backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return {name: p.detach() for name, p in model.named_parameters()}, norm


def _check_against(results: list[dict], weights: dict[str, torch.Tensor], norm: float) -> None:
    assert norm > 5 * CLIP  # clipping is active
    for r in results:
        assert r["skipped"] == 0 and r["norm"] == pytest.approx(norm, rel=1e-6)
        assert sorted(r["weights"]) == sorted(STAGES[r["stage"]])
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, weights[name], rtol=1e-6, atol=1e-7)


def test_fp32_clipping_spans_stages_and_counts_the_tied_copy_once():
    weights, norm = _torch_reference()
    _check_against(run_distributed(_stage_body, world_size=2, args=("fp32", 0, 1), timeout=60), weights, norm)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_clipping_spans_stages(precision):
    whole = run_distributed(_whole_body, world_size=1, args=(precision,), timeout=60)[0]
    results = run_distributed(_stage_body, world_size=2, args=(precision, 0, 1), timeout=60)
    _check_against(results, whole["weights"], whole["norm"])


def test_zero1_clipping_spans_stages_and_data_parallel_partitions():
    weights, norm = _torch_reference()
    results = run_distributed(_stage_body, world_size=4, args=("fp32", 1, 2), timeout=90)
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    _check_against(results, weights, norm)


@pytest.mark.parametrize(("precision", "zero", "dp", "poison"), [
    ("fp16", 0, 1, (1, "mid")),  # a stage's own gradient
    ("bf16", 0, 1, (1, "w")),  # the tied copy, left out of the norm: still an overflow
    ("bf16", 1, 2, (3, "b2")),  # one data-parallel rank of stage 1: stage 0 learns it over the model group
])
def test_overflow_on_one_rank_skips_every_rank(precision, zero, dp, poison):
    start = Tied()
    results = run_distributed(_stage_body, world_size=2 * dp, args=(precision, zero, dp, poison), timeout=90)
    assert len({r["scale"] for r in results}) == 1  # every rank updated its loss scaler alike
    for r in results:
        assert r["skipped"] == 1 and r["norm"] is None
        for name, value in r["weights"].items():
            low = getattr(start, name).detach().to(getattr(torch, {"bf16": "bfloat16"}.get(precision, "float16")))
            torch.testing.assert_close(value, low.float(), rtol=0, atol=0)
