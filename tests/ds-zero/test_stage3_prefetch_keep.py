"""ZeRO-3 prefetch keeps what its walk of the trace passed while it was gathered: once a pass replays the trace,
a layer's weights stay gathered after its forward until their use in backward (as DeepSpeed keeps what its
prefetch skipped) instead of being released and gathered again; a walk blocked by ``max_live_parameters`` waits.
Training is bitwise the same as without prefetch, over repeated runs with jittered timing on 2 gloo ranks, and
nothing stays gathered after a step."""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

DIM, LAYERS, STEPS = 8, 4, 3
LAYER_NUMEL = DIM * DIM + DIM
BASE = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 0.05}}}
NO_PREFETCH = {"stage3_prefetch_bucket_size": 0}
PREFETCH_ALL = {"stage3_prefetch_bucket_size": LAYERS * LAYER_NUMEL}
LIVE_CAPPED = {"stage3_prefetch_bucket_size": LAYERS * LAYER_NUMEL, "stage3_max_live_parameters": 2 * LAYER_NUMEL}


class _Net(torch.nn.Module):
    """Layers run by the parent, which looks at each layer's weight once the layer's forward (and its hooks,
    the scheduler's release among them) is over, sleeping a jittered while there."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(DIM, DIM) for _ in range(LAYERS)])
        self.jitter: random.Random | None = None
        self.kept: list[list[bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self.kept.append([])
        for layer in self.layers:
            x = torch.tanh(layer(x))
            if self.jitter is not None:
                time.sleep(self.jitter.random() * 0.004)  # the ranks reach their gathers' waits at other times
            # parameters(), not layer.weight: reading the attribute here would gather it for this module
            self.kept[-1].append(all(p.ds_status is ZeroParamStatus.AVAILABLE for p in layer.parameters()))
        return x


def _train(extra: dict, jitter_seed: int | None) -> dict:
    import deepspeed

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _Net()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, **extra}
    engine, *_ = deepspeed.initialize(model=model, config={**BASE, "zero_optimization": zero})
    if jitter_seed is not None:
        model.jitter = random.Random(jitter_seed * 10 + rank)
    gen = torch.Generator().manual_seed(1)
    losses, gathered = [], []
    for _ in range(STEPS):
        x = torch.randn(4, DIM, generator=gen)[2 * rank:2 * rank + 2]
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
        gathered.append(sum(p.numel() for p in engine.module.parameters()))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return {"losses": losses, "weights": weights, "kept": model.kept, "gathered": gathered}


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return run_distributed(_train, world_size=2, args=(NO_PREFETCH, None), timeout=240)


def _assert_bitwise(got: list[dict], want: list[dict]) -> None:
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[rank]["losses"], want[rank]["losses"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got[rank]["weights"], want[rank]["weights"], strict=True))
        assert got[rank]["gathered"] == [0] * STEPS  # the step releases what prefetch kept


def test_without_prefetch_each_layer_is_released_after_its_forward(reference):
    for rank in range(2):
        assert reference[rank]["kept"] == [[False] * LAYERS] * STEPS


def test_prefetched_weights_stay_gathered_until_backward_and_train_bitwise_the_same(reference):
    for seed in range(3):
        got = run_distributed(_train, world_size=2, args=(PREFETCH_ALL, seed), timeout=240)
        _assert_bitwise(got, reference)
        for rank in range(2):
            # the first pass records the trace; from the second on every layer is kept for its backward
            assert got[rank]["kept"] == [[False] * LAYERS] + [[True] * LAYERS] * (STEPS - 1)


def test_a_walk_blocked_by_max_live_parameters_trains_bitwise_the_same(reference):
    for seed in range(2):
        got = run_distributed(_train, world_size=2, args=(LIVE_CAPPED, seed), timeout=240)
        _assert_bitwise(got, reference)
