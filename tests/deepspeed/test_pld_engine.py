"""Progressive Layer Dropping through the engine: training forwards get DeepSpeed's keywords with the schedule's
keep probability, eval forwards none, ``get_pld_theta`` follows the steps, a model without the keywords fails."""

from __future__ import annotations

import numpy as np
import torch
from _harness import run_distributed


class _Recorder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.seen: list[dict] = []

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        self.seen.append(dict(kwargs))
        return self.lin(x).square().mean()


def _body() -> tuple[list[dict], list[float | None], str]:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.1}}
    model = _Recorder()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    thetas = []
    for _ in range(3):
        engine.backward(engine(torch.randn(1, 4)))
        engine.step()
        thetas.append(engine.get_pld_theta())
    engine.eval()
    engine(torch.randn(1, 4))
    plain, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 1), config=config)
    try:
        plain(torch.randn(1, 4))
        error = "none"
    except TypeError as exc:
        error = str(exc)
    return model.seen, thetas, error


def test_pld_keywords_reach_the_training_forward_only() -> None:
    seen, thetas, error = run_distributed(_body, world_size=1, timeout=120)[0]
    expected = [(1.0 - 0.5) * np.exp(-0.1 * step) + 0.5 for step in range(4)]  # DeepSpeed's formula, bit for bit
    assert [s["pld_theta"] for s in seen[:3]] == expected[:3]  # forward k sees the schedule after k steps
    assert all(s["progressive_layer_drop"] is True for s in seen[:3])
    assert seen[3] == {}  # eval: no keywords
    assert thetas == expected[:3]  # get_pld_theta: the value the last forward used
    assert "pld_theta" in error or "progressive_layer_drop" in error
