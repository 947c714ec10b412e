"""The stage links under ``PipelineEngine`` on real gloo ranks: a step sends one message per activation and per
gradient, as DeepSpeed's pipeline does; ``eval_batch`` between ``train_batch`` calls works with static shapes
and changes nothing; and a layer that fails in its forward or backward pass at any micro-batch, on any stage of 2
or 3, makes every stage raise that error instead of hanging."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import DistributedTestFailure, run_distributed
from _pipe_models import mlp_batches
from torch import nn

GAS = 8


class _Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("boom in backward")


class Bomb(nn.Module):
    """Identity, except at its ``at``-th training micro-batch: raises in the forward or the backward pass."""

    def __init__(self, at: int | None = None, phase: str = "forward") -> None:
        super().__init__()
        self.at, self.phase, self.calls = at, phase, 0

    def forward(self, x):
        if not torch.is_grad_enabled():
            return x
        self.calls += 1
        if self.calls - 1 != self.at:
            return x
        if self.phase == "forward":
            raise ValueError(f"boom at micro-batch {self.at}")
        return _Fails.apply(x)


def _engine(stages: int, bombs: dict | None = None):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    bombs = bombs or {}
    specs = []
    for stage in range(stages):
        specs += [LayerSpec(nn.Linear, 8, 8), LayerSpec(Bomb, *bombs.get(stage, ())), LayerSpec(nn.Tanh)]
    module = PipelineModule(specs, num_stages=stages, loss_fn=nn.MSELoss(), partition_method="uniform",
                            seed_layers=True)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    return deepspeed.initialize(model=module, config=config)[0]


def _messages_per_step() -> list[int]:
    engine = _engine(2)
    it = iter(mlp_batches(3 * GAS))
    engine.train_batch(it)  # the first step also sends the layout
    counts, original = [], dist.isend

    def counting(*args, **kwargs):
        counts[-1] += 1
        return original(*args, **kwargs)

    dist.isend = counting
    try:
        for _ in range(2):
            counts.append(0)
            engine.train_batch(it)
    finally:
        dist.isend = original
    return counts


def test_one_message_per_activation_and_gradient():
    assert run_distributed(_messages_per_step, world_size=2, timeout=120) == [[GAS, GAS], [GAS, GAS]]


def _with_eval(evaluate: bool) -> list[float]:
    engine = _engine(2)
    data = mlp_batches(4 * GAS)
    it, out = iter(data), []
    for step in range(3):
        out.append(float(engine.train_batch(it)))
        if evaluate and step < 2:
            out.append(float(engine.eval_batch(iter(data[:GAS]))))
    return out


def test_eval_between_train_batches_with_static_shapes():
    plain = run_distributed(_with_eval, world_size=2, args=(False,), timeout=120)
    mixed = run_distributed(_with_eval, world_size=2, args=(True,), timeout=120)
    assert mixed[0] == mixed[1] and plain[0] == plain[1]
    assert [mixed[0][i] for i in (0, 2, 4)] == plain[0]  # evaluating changes no weight (bitwise)
    assert mixed[0][1] == pytest.approx(mixed[0][3], abs=1) and mixed[0][1] != mixed[0][3]


def _failing(stages: int, stage: int, at: int, phase: str, step: int) -> None:
    engine = _engine(stages, {stage: (at, phase)} if step == 0 else None)
    it = iter(mlp_batches(2 * GAS))
    engine.train_batch(it)
    if step == 1:  # fail in the second batch: the layouts are known and the frames already flowing
        bomb = next(m for m in engine.module.modules() if isinstance(m, Bomb)) if stage == engine.stage_id else None
        if bomb is not None:
            bomb.at, bomb.phase, bomb.calls = at, phase, 0
        engine.train_batch(it)


@pytest.mark.parametrize(("stages", "stage", "at", "phase", "step"), [
    (2, 0, 0, "forward", 0), (2, 1, 0, "forward", 0), (2, 0, 5, "forward", 1), (2, 1, GAS - 1, "forward", 1),
    (2, 0, 3, "backward", 1), (2, 1, 0, "backward", 0), (3, 1, 2, "forward", 1), (3, 2, 0, "backward", 1),
    (3, 0, GAS - 1, "forward", 0)])
def test_a_failing_stage_fails_every_stage(stages, stage, at, phase, step):
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_failing, world_size=stages, args=(stages, stage, at, phase, step), timeout=60)
    text = str(info.value)
    cause = f"boom at micro-batch {at}" if phase == "forward" else "boom in backward"
    assert text.count(cause) >= stages, text  # every rank raised with the failing stage's error
    assert "PipelineAbort" in text and "timed out" not in text.lower()


def _sliced(pipe_partitioned: bool, grad_partitioned: bool) -> float:
    """2 stages x 2 tensor slices (each a full copy of its stage), activations and gradients split or not."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from ds_pipe import PipeModelDataParallelTopology

    specs = [LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.Tanh)] * 2
    module = PipelineModule(specs, topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1),
                            loss_fn=nn.MSELoss(), seed_layers=True)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "pipeline": {"pipe_partitioned": pipe_partitioned, "grad_partitioned": grad_partitioned}}
    engine = deepspeed.initialize(model=module, config=config)[0]
    it = iter(mlp_batches(4))
    engine.train_batch(it)
    return float(engine.train_batch(it))


def test_activations_and_gradients_split_by_their_own_settings():
    whole = run_distributed(_sliced, world_size=4, args=(False, False), timeout=120)
    for flags in ((True, False), (False, True)):
        assert run_distributed(_sliced, world_size=4, args=flags, timeout=120) == whole
