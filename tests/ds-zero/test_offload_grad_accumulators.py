"""ZeRO 1/2 with CPU offload: ``accumulated_grads_in_cpu`` (DeepSpeed's name) lists the per-parameter gradient
accumulators held in CPU memory between micro-steps. Stage 1: one backward per step holds none; fp32 accumulation
of bf16 gradients holds one per parameter until the step. Stage 2: the gradients accumulated so far in the
window, read from the gradient partition (each rank the pieces its partition owns), so they change with every
micro-step (DeepSpeed's PR 7967 regression: they stayed frozen after the first). Without offload the attribute
does not exist, as in DeepSpeed."""

from __future__ import annotations

import torch
from _harness import run_distributed


def _body(stage: int, offload: bool, fp32_accum: bool, gas: int) -> dict:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
              "zero_optimization": zero, "bf16": {"enabled": True}, "zero_force_ds_cpu_optimizer": False,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    if fp32_accum:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    if not hasattr(engine.optimizer, "accumulated_grads_in_cpu"):
        return {"exists": False}
    seen = []
    x = torch.randn(gas, 4, dtype=torch.bfloat16)
    for i in range(gas):
        loss = engine(x[i:i + 1]).float().pow(2).sum()
        engine.backward(loss)
        held = engine.optimizer.accumulated_grads_in_cpu
        seen.append((len(held), all(t.dtype == torch.float32 and t.device.type == "cpu" for t in held.values())))
        engine.step()
    return {"exists": True, "during": seen, "after": len(engine.optimizer.accumulated_grads_in_cpu),
            "params": len(list(model.parameters()))}


def test_stage1_single_backward_holds_no_cpu_accumulator():
    (r,) = run_distributed(_body, world_size=1, args=(1, True, False, 1), timeout=120)
    assert r["exists"] and r["during"] == [(0, True)] and r["after"] == 0


def test_stage1_fp32_accumulation_holds_one_per_parameter_until_the_step():
    (r,) = run_distributed(_body, world_size=1, args=(1, True, True, 2), timeout=120)
    assert r["during"] == [(r["params"], True), (r["params"], True)]
    assert r["after"] == 0


def test_without_offload_the_attribute_is_absent():
    (r,) = run_distributed(_body, world_size=1, args=(2, False, False, 1), timeout=120)
    assert r == {"exists": False}


def _stage2_body(gas: int) -> dict:
    import torch.distributed as dist

    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    reference = [p.detach().float().clone() for p in model.parameters()]
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True},
              "zero_force_ds_cpu_optimizer": False,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    xs = torch.randn(world, gas, 4, generator=torch.Generator().manual_seed(1))
    expected = [torch.zeros_like(w) for w in reference]
    held, wanted = [], []
    for i in range(gas):
        engine.backward(engine(xs[rank, i:i + 1].to(torch.bfloat16)).float().pow(2).sum())
        for r in range(world):  # the fp32 gradient of every rank's micro-batch: the window's running mean
            ws = [w.clone().requires_grad_(True) for w in reference]
            h = torch.tanh(xs[r, i:i + 1] @ ws[0].t() + ws[1])
            ((h @ ws[2].t() + ws[3]).pow(2).sum() / gas / world).backward()
            for e, w in zip(expected, ws, strict=True):
                e.add_(w.grad)
        grads = engine.optimizer.accumulated_grads_in_cpu
        held.append({k: v.float().clone() for k, v in grads.items()})
        wanted.append([e.reshape(-1).clone() for e in expected])
    return {"held": held, "wanted": wanted, "numel": sum(p.numel() for p in model.parameters()),
            "devices": {v.device.type for v in grads.values()}}


def test_stage2_holds_the_window_accumulation_each_micro_step():
    results = run_distributed(_stage2_body, world_size=2, args=(3,), timeout=180)
    assert all(r["devices"] == {"cpu"} for r in results)
    for step in range(3):
        pieces: dict[int, list[torch.Tensor]] = {}
        for r in results:  # rank order: a parameter split across partitions is its rank-0 piece then rank 1's
            for k, v in r["held"][step].items():
                pieces.setdefault(k, []).append(v)
        wanted = results[0]["wanted"][step]
        assert sorted(pieces) == list(range(len(wanted)))
        assert sum(t.numel() for ts in pieces.values() for t in ts) == results[0]["numel"]
        for k, w in enumerate(wanted):
            torch.testing.assert_close(torch.cat(pieces[k]), w, rtol=3e-2, atol=3e-2)
    norms = [sum(float(v.norm()) ** 2 for v in results[0]["held"][s].values()) for s in range(3)]
    assert norms[0] > 0 and norms[1] != norms[0] and norms[2] != norms[1]
