"""Review reproductions for ZeRO-3 parameter gathering: a parameter another module reads while it is already
gathered (by a prefetch) is still an external parameter of the reader, and a gather in flight is waited for by
``GatheredParameters`` (and computing with it before is a clear error). Trained against stage 0 on 2 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

VOCAB, DIM = 11, 8
BASE = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}}}
PREFETCH = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 10**6,
            "stage3_max_reuse_distance": 0}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.lin = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class LateExternal(torch.nn.Module):
    """From the third forward on, the root also uses ``blocks[2].lin.weight`` (a new external use once the
    trace prefetches: the weight is already gathered when the root reads it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.embed(ids)
        if self.calls > 2:
            h = h + 0.1 * torch.nn.functional.linear(h, self.blocks[2].lin.weight)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _whole(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def _train(zero: dict, steps: int) -> dict:
    import deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=LateExternal(), config={**BASE, "zero_optimization": zero})
    gen = torch.Generator().manual_seed(3)
    losses, gathered = [], []
    for _ in range(steps):
        x, y = torch.randint(VOCAB, (4 * world, 4), generator=gen), torch.randint(VOCAB, (4 * world, 4), generator=gen)
        out = engine(x[rank * 4:rank * 4 + 4])
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB), y[rank * 4:rank * 4 + 4].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        gathered.append(sum(p.numel() for p in engine.module.parameters()))
    return {"losses": losses, "weights": _whole(engine.module), "gathered": gathered}


def test_parameter_gathered_by_prefetch_and_read_by_another_module():
    got = run_distributed(_train, world_size=2, args=(PREFETCH, 5), timeout=60)
    base = run_distributed(_train, world_size=2, args=({"stage": 0}, 5), timeout=60)
    for name, want in base[0]["weights"].items():
        assert float((got[0]["weights"][name] - want).norm() / want.norm()) <= 1e-5, name
    assert got[0]["losses"] == pytest.approx(base[0]["losses"], rel=1e-5)
    assert got[0]["gathered"] == [0] * 5  # everything released after each step


def _in_flight() -> dict:
    import deepspeed
    from ds_zero.zero3._collectives import start_gather
    from ds_zero.zero3.convert import convert_param
    from ds_zero.zero3.param import PartitionSpace

    p = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    convert_param(p, PartitionSpace.of(None, "cpu", "cpu"))
    pending = start_gather([p])  # a prefetch in flight
    try:
        p.sum()
        computed = "no error"
    except RuntimeError as exc:
        computed = str(exc)
    with deepspeed.zero.GatheredParameters(p):
        inside = p.detach().clone()
    pending.wait()
    return {"computed": computed, "inside": inside, "status": p.ds_status.name}


def test_gathered_parameters_waits_for_a_gather_in_flight():
    out = run_distributed(_in_flight, world_size=1, timeout=30)[0]
    assert torch.equal(out["inside"], torch.arange(6.0).reshape(2, 3))
    assert out["status"] == "AVAILABLE"
    assert "GatheredParameters" in out["computed"]  # never a silent computation on the empty tensor


class _Reentrant(torch.nn.Module):
    """The same weight inside a reentrant checkpoint and outside it: its gradient lands twice in one backward
    (the checkpoint's nested backward accumulates first), the second time after its bucket may have left."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.shared(t)), x, use_reentrant=True)
        return self.head(torch.tanh(self.shared(h)))


def _reentrant_run(zero: dict) -> dict:
    import deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _Reentrant()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(4)
    losses = []
    for _ in range(4):
        x = torch.randn(2 * world, 6, generator=gen, requires_grad=True)
        loss = engine(x[2 * rank:2 * rank + 2]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {"losses": losses, "w": model.shared.weight.detach().clone()}


def _reentrant_reference() -> dict:
    """One process, the whole global batch (stage 0 refuses this model: its all-reduce may not see a gradient
    twice)."""
    torch.manual_seed(0)
    model = _Reentrant()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    gen = torch.Generator().manual_seed(4)
    losses = []
    for _ in range(4):
        x = torch.randn(4, 6, generator=gen, requires_grad=True)
        halves = [model(x[:2]).pow(2).mean(), model(x[2:]).pow(2).mean()]
        opt.zero_grad()
        (sum(halves) / 2).backward()
        opt.step()
        losses.append(float(halves[0].detach()))
    return {"losses": losses, "w": model.shared.weight.detach().clone()}


@pytest.mark.parametrize("bucket", [10, 10**6])
def test_gradient_landing_twice_in_one_backward_is_not_lost(bucket):
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": bucket}
    got = run_distributed(_reentrant_run, world_size=2, args=(zero,), timeout=60)
    want = _reentrant_reference()
    assert got[0]["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert torch.allclose(got[0]["w"], want["w"], rtol=1e-5, atol=1e-7)
