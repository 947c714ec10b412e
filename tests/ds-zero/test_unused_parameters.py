"""``ignore_unused_parameters: false`` (stage 2) when only one rank leaves a parameter without a gradient: every
rank raises, none is left waiting in a collective."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _harness import run_distributed


class _Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.sometimes = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        x = self.used(x)
        return x if skip else self.sometimes(x)


def _body() -> str:
    import deepspeed

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": 2, "ignore_unused_parameters": False}}
    engine, _, _, _ = deepspeed.initialize(model=_Branchy(), config=config)
    try:
        engine.backward(engine(torch.randn(2, 4), skip=dist.get_rank() == 0).sum())
    except RuntimeError as exc:
        assert isinstance(exc, AssertionError)  # DeepSpeed asserts here; its callers catch AssertionError
        return str(exc)
    return "no error"


def test_an_unused_parameter_on_one_rank_fails_every_rank():
    rank0, rank1 = run_distributed(_body, world_size=2, timeout=30)
    assert "received no gradient on this rank" in rank0 and "(4, 4)" in rank0
    assert "another rank had parameters without a gradient" in rank1
    assert all("ignore_unused_parameters" in m for m in (rank0, rank1))
