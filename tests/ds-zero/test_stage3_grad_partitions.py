"""``DeepSpeedZeroOptimizer_Stage3.get_fp32_grad_partitions()``: this rank's accumulated gradient partitions in
fp32, ``[sub-group][index in it]``, equal to the slices of the data-parallel mean gradient over the accumulation
window (zero padded at the end), with and without optimizer offload, cleared by ``zero_grad``; the same values
through DeepSpeed's ``averaged_gradients`` (and ``fp16_groups`` lists the parameters), after the engine's
``allreduce_gradients()`` (a no-op: backward reduced them)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

SHAPES = [(3, 5), (4,), (2, 3)]


class _Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*s)) for s in SHAPES])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w[0].t()).sum() * self.w[1].sum() + self.w[2].pow(2).sum()


def _reference_grads(world: int, steps: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _Chain()
    for step in range(steps):
        for rank in range(world):
            x = torch.full((2, 5), float(1 + rank + step))
            (model(x) / (world * steps)).backward()  # the engine divides by the accumulation steps
    return [p.grad.reshape(-1) for p in model.w]


def _partitions(offload: bool, steps: int) -> dict:
    import deepspeed

    torch.manual_seed(0)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": steps, "steps_per_print": 10**6,
              "zero_optimization": zero, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}
    engine, *_ = deepspeed.initialize(model=_Chain(), config=config)
    for step in range(steps):
        x = torch.full((2, 5), float(1 + dist.get_rank() + step))
        engine.backward(engine(x))
        engine.allreduce_gradients()
    parts = engine.optimizer.get_fp32_grad_partitions()
    out = {gi: {k: t.clone() for k, t in group.items()} for gi, group in parts.items()}
    averaged = {gi: [t.float().clone() for t in ts] for gi, ts in engine.optimizer.averaged_gradients.items()}
    groups = [[tuple(p.ds_shape) for p in ps] for ps in engine.optimizer.fp16_groups]
    engine.optimizer.zero_grad()
    cleared = [float(t.abs().sum()) for t in engine.optimizer.get_fp32_grad_partitions()[0].values()]
    engine.destroy()
    return {"parts": out, "cleared": cleared, "averaged": averaged, "groups": groups}


@pytest.mark.parametrize("offload", [False, True])
def test_grad_partitions_are_slices_of_the_mean_gradient(offload):
    world, steps = 2, 2
    got = run_distributed(_partitions, world_size=world, args=(offload, steps), timeout=90)
    full = _reference_grads(world, steps)
    for rank, out in enumerate(got):
        assert list(out["parts"]) == [0] and sorted(out["parts"][0]) == [0, 1, 2]
        for index, want in enumerate(full):
            part = -(-want.numel() // world)
            padded = torch.cat([want, torch.zeros(part * world - want.numel())])
            have = out["parts"][0][index]
            assert have.dtype == torch.float32
            torch.testing.assert_close(have, padded[rank * part:(rank + 1) * part], rtol=1e-5, atol=1e-5)
        assert out["cleared"] == [0.0, 0.0, 0.0]
        assert out["groups"] == [SHAPES]
        for have, want in zip(out["averaged"][0], out["parts"][0].values(), strict=True):
            assert torch.equal(have, want)
