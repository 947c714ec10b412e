"""``zero.Init`` with ``torch.nn.utils.skip_init`` modules (built on the meta device, then given storage by
``to_empty``): they are partitioned once they have storage, nested in a parent or at the top, instead of failing
to copy out of meta tensors; ``Module.to_empty`` is torch's own again after the context. 2 gloo ranks."""

from __future__ import annotations

import torch
from _harness import run_distributed


class _Sub(torch.nn.Module):
    def __init__(self, size: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(size, size, device=device)
        self.stack = torch.nn.ModuleList([torch.nn.Linear(size, size, device=device)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stack[0](self.linear(x))


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.utils.skip_init(torch.nn.Linear, 10, 10)
        self.sub = torch.nn.utils.skip_init(_Sub, 10)
        self.last = torch.nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.sub(self.first(x)))


def _run() -> dict:
    import deepspeed

    original = torch.nn.Module.to_empty
    config = {"train_batch_size": 4, "steps_per_print": 10**6, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = _Model()
        alone = torch.nn.utils.skip_init(_Sub, 10)
    restored = torch.nn.Module.to_empty is original
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        for p in model.parameters():  # skip_init leaves the values unset: give them some
            torch.nn.init.constant_(p, 0.01)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    loss = engine(torch.ones(2, 10)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    parts = [p.ds_tensor.numel() for p in list(model.parameters()) + list(alone.parameters())]
    engine.destroy()
    return {"parts": parts, "restored": restored, "finite": bool(torch.isfinite(loss))}


def test_skip_init_modules_are_partitioned():
    for out in run_distributed(_run, world_size=2, timeout=90):
        assert out["parts"] == [50, 5] * 6  # every 10x10 weight and 10-bias split over 2 ranks
        assert out["restored"] and out["finite"]
