"""A client optimizer whose state is not per element (a step counter kept as a one-element tensor) saves and
loads at ZeRO stages 1-3: only per-element states must have the partition's size."""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed


class CountingSGD(torch.optim.Optimizer):
    """SGD that counts its steps in an int and in a one-element tensor."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["count"], state["count_tensor"] = 0, torch.zeros(1)
                p.add_(p.grad, alpha=-group["lr"])
                state["count"] += 1
                state["count_tensor"] += 1


def _body(stage: int, save_dir: str) -> dict:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**6}

    def engine():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
        return deepspeed.initialize(model=model, optimizer=CountingSGD(model.parameters()), config=config)[0]

    first = engine()
    for i in range(3):
        first.backward(first(torch.randn(2, 5, generator=torch.Generator().manual_seed(i))).sum())
        first.step()
    first.save_checkpoint(save_dir, tag="t")
    second = engine()
    second.load_checkpoint(save_dir, tag="t")
    states = [s for s in second.optimizer.optimizer.state.values() if s]
    return {"count": [s["count"] for s in states], "tensor": [s["count_tensor"].tolist() for s in states]}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_per_group_tensor_state_loads(stage, tmp_path):
    for out in run_distributed(_body, world_size=2, args=(stage, str(tmp_path)), timeout=120):
        assert out["count"] and set(out["count"]) == {3} and all(t == [3.0] for t in out["tensor"]), out
