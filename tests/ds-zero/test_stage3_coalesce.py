"""``engine.coalesce_grad_reduction()`` under ZeRO-3 on 2 gloo ranks: the backward calls inside only fill the
reduce-scatter buckets and the engine's ``_flush_coalesced_reduction_zero3`` sends them once at the block's end,
as the first reduction of the window (``optimizer.micro_step_id`` 0, which counts reductions since
``zero_grad``); fewer exchanges than a reduction per backward, through ``deepspeed.comm.reduce_scatter_fn`` where
the reducer uses the reduce-scatter collective (gloo with few ranks uses point to point instead), with the same
weights either way; and ``deepspeed.comm.reduce_scatter_fn`` on its own."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

CHUNKS, STEPS = 3, 2


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _coalesce_body(coalesce: bool, collective: bool) -> dict:
    """GAS 1, three backward calls per step; ``collective``: the reducer uses reduce_scatter_fn instead of the
    point-to-point exchange it picks on gloo. Counts the exchanges of each window and records micro_step_id."""
    import deepspeed
    import deepspeed.comm as ds_comm

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2 * CHUNKS, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**6, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=_Net(), config=config)
    if collective:
        engine.reducer.p2p = False
    counts = {"reduce_scatter_fn": 0, "batch_isend_irecv": 0}
    originals = {name: getattr(ds_comm, name) for name in counts}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    flushes = []
    flush = engine._flush_coalesced_reduction_zero3
    engine._flush_coalesced_reduction_zero3 = lambda opt: (flushes.append(opt.micro_step_id), flush(opt))
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    windows, after = [], []
    for _ in range(STEPS):
        x, y = torch.randn(2 * CHUNKS, 6, generator=gen), torch.randn(2 * CHUNKS, 3, generator=gen)
        for name in counts:
            counts[name] = 0
            setattr(ds_comm, name, counting(name))
        try:
            with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
                for xc, yc in zip(x.split(2), y.split(2), strict=True):
                    engine.backward(torch.nn.functional.mse_loss(engine(xc), yc))
        finally:
            for name, fn in originals.items():
                setattr(ds_comm, name, fn)
        windows.append(dict(counts))
        after.append(engine.optimizer.micro_step_id)
        engine.step()
        after.append(engine.optimizer.micro_step_id)
    buckets = len(engine.reducer.buckets)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return {"windows": windows, "flushes": flushes, "after": after, "state": state,
            "buckets": buckets}


@pytest.mark.parametrize("collective", [False, True])
def test_coalesced_zero3_one_exchange_per_window(collective):
    plain = run_distributed(_coalesce_body, world_size=2, args=(False, collective), timeout=90)
    merged = run_distributed(_coalesce_body, world_size=2, args=(True, collective), timeout=90)
    op = "reduce_scatter_fn" if collective else "batch_isend_irecv"
    for rank in range(2):
        base, got = plain[rank]["windows"], merged[rank]["windows"]
        assert all(w[op] > 0 for w in base), base
        assert collective or all(w["reduce_scatter_fn"] == 0 for w in base + got), (base, got)
        buckets = merged[rank]["buckets"]
        if collective:  # one reduce_scatter_fn per bucket and window instead of one per bucket and backward
            assert [w[op] for w in got] == [buckets] * STEPS and [w[op] for w in base] == [CHUNKS * buckets] * STEPS
        else:  # batch_isend_irecv also carries the parameter gathers: only the reductions' share drops
            assert [b[op] - g[op] for b, g in zip(base, got, strict=True)] == [(CHUNKS - 1) * buckets] * STEPS
        assert merged[rank]["flushes"] == [0] * STEPS  # the flush is the window's first reduction
        assert plain[rank]["flushes"] == []
        # micro_step_id after the window (before step), then after step (zero_grad starts a new window)
        assert merged[rank]["after"] == [1, 0] * STEPS
        assert plain[rank]["after"] == [CHUNKS, 0] * STEPS
    for key, value in plain[0]["state"].items():
        torch.testing.assert_close(merged[0]["state"][key], value, rtol=1e-5, atol=1e-6)
        assert torch.equal(merged[1]["state"][key], merged[0]["state"][key])


def _reduce_scatter_fn_body() -> dict:
    import deepspeed.comm as ds_comm

    rank, world = dist.get_rank(), dist.get_world_size()
    flat = torch.arange(world * 3, dtype=torch.float32) * (rank + 1)
    out = torch.empty(3)
    ds_comm.reduce_scatter_fn(out, flat)
    work = ds_comm.reduce_scatter_fn(out2 := torch.empty(3), flat, async_op=True)
    work.wait()
    return {"sync": out, "async": out2}


def test_reduce_scatter_fn_sums_each_ranks_chunk():
    got = run_distributed(_reduce_scatter_fn_body, world_size=2, timeout=60)
    for rank in range(2):
        want = torch.arange(rank * 3, rank * 3 + 3, dtype=torch.float32) * 3  # ranks scale by 1 and 2
        assert torch.equal(got[rank]["sync"], want)
        assert torch.equal(got[rank]["async"], want)
