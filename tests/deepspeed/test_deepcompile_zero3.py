"""DeepCompile over ZeRO-3 (``compile: {deepcompile: true}``, ``engine.compile()``) trains exactly like the eager
ZeRO-3 engine: 2 real gloo ranks, gradient accumulation, a graph break, same losses and weights bitwise, the
parameters gathered by the graphs' own ``dc`` operators and released between steps."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _harness import run_distributed


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.hidden = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        torch._dynamo.graph_break()  # two compiled graphs, each gathering its own parameters
        h = torch.tanh(self.hidden(h)) + h
        return self.out(h) + self.inp.bias.sum()  # a parameter of the first graph read again in the second


def _train(deepcompile: bool, steps: int, stage: int = 3) -> dict:
    import deepspeed
    from deepspeed.compile.util import get_deepcompile_handle

    torch.manual_seed(0)
    gathers_before = get_deepcompile_handle().gathers  # the harness may reuse a worker process
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}, "compile": {"deepcompile": deepcompile}}
    engine, *_ = deepspeed.initialize(model=_Net(), config=config)
    if deepcompile:
        engine.compile(backend="eager")
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses, released = [], []
    for _ in range(steps):
        loss = engine(torch.randn(2, 8, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        released.append(stage < 3 or all(p.data.numel() == 0 for p in engine.module.parameters()))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        weights = [p.detach().clone() for p in engine.module.parameters()]
    result = {"losses": losses, "weights": weights, "released": released,
              "gathers": get_deepcompile_handle().gathers - gathers_before, "active": engine.is_deepcompile_active()}
    engine.destroy()
    return result


def _compare() -> dict:
    eager = _train(False, 4)  # 4 micro-steps: 2 optimizer steps of 2 accumulated backward passes
    compiled = _train(True, 4)
    return {"eager": eager, "compiled": compiled}


def test_deepcompile_zero3_matches_eager_zero3_bitwise():
    for rank in run_distributed(_compare, world_size=2, timeout=240):
        eager, compiled = rank["eager"], rank["compiled"]
        assert compiled["active"] and not eager["active"]
        assert compiled["gathers"] > 0  # the graphs' allgather_param ran
        assert compiled["losses"] == eager["losses"]
        assert all(torch.equal(a, b) for a, b in zip(compiled["weights"], eager["weights"], strict=True))
        assert all(compiled["released"])  # no whole parameter outlives its step


def _stage0_and_stage2() -> dict:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "compile": {"deepcompile": True}}
    engine, *_ = deepspeed.initialize(model=_Net(), config=config)
    engine.compile(backend="eager")  # stage 0: plain torch.compile, as in DeepSpeed
    stage0 = (engine.is_compiled, engine.is_deepcompile_active())
    engine.destroy()
    return {"stage0": stage0, "eager": _train(False, 2, stage=2), "compiled": _train(True, 2, stage=2)}


def test_deepcompile_stage0_compiles_plainly_and_stage2_trains_like_eager():
    for rank in run_distributed(_stage0_and_stage2, world_size=2, timeout=240):
        assert rank["stage0"] == (True, False)
        assert rank["compiled"]["active"] and rank["compiled"]["losses"] == rank["eager"]["losses"]
        assert all(torch.equal(a, b) for a, b in zip(rank["compiled"]["weights"], rank["eager"]["weights"],
                                                      strict=True))
