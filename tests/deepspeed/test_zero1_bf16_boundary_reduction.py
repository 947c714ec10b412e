"""ZeRO-1 + bf16 + fp32 gradient accumulation (DeepSpeed runs its ``BF16_Optimizer`` here; this engine its ZeRO-1
optimizer, docs/deviations.md): the boundary micro-step's gradient is accumulated before the window is reduced,
so each rank's fp32 gradient partition holds its slice of the data-parallel mean of the whole window (DeepSpeed
issue: the boundary micro-batch was left out of the reduction). Hand-computed: two micro-batches per rank, loss
``sum(w * x)``, so each gradient is ``x / 2`` (the loss is divided by the accumulation steps)."""

from __future__ import annotations

import torch
from _harness import run_distributed


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


def _body() -> dict:
    import torch.distributed as dist

    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "bf16": {"enabled": True, "immediate_grad_update": False}, "data_types": {"grad_accum_dtype": "fp32"}}
    model = _Scale()
    engine, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())
    shift = 18 * dist.get_rank()
    for i, x in enumerate(([1, 3, 5, 7], [11, 13, 15, 17])):
        engine.set_gradient_accumulation_boundary(i == 1)
        engine.backward(engine(torch.tensor(x, dtype=torch.bfloat16) + shift))
    fg = engine.optimizer.groups[0]
    return {"partition": fg.grad_partition.tolist(), "dtype": str(fg.grad_partition.dtype)}


def test_boundary_micro_batch_is_in_the_reduced_partitions():
    # rank 0: (1+11)/2.. = [6, 8, 10, 12]; rank 1: +18 each = [24, 26, 28, 30]; mean [15, 17, 19, 21]
    r0, r1 = run_distributed(_body, world_size=2, timeout=120)
    assert r0 == {"partition": [15.0, 17.0], "dtype": "torch.float32"}
    assert r1 == {"partition": [19.0, 21.0], "dtype": "torch.float32"}
