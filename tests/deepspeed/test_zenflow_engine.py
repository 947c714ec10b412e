"""ZenFlow under ZeRO stage 1/2 with CPU offload, end to end on 2 gloo ranks, against a single-process reference.

The reference replays the schedule by hand, with plain torch:

- full steps: ``torch.optim.AdamW`` on an fp32 master copy, fed the mean of the window's averaged gradients;
- selective steps: the AdamW formula on the selected columns;
- selection: the top columns by absolute gradient sum.

The engine's weights must match it, both ranks must hold identical weights, and off an update step the
columns outside the selection must not move at all.
"""

from __future__ import annotations

import pytest
import torch
from _harness import run_distributed

STEPS, LR, WD, BETAS, EPS = 8, 1e-2, 0.01, (0.9, 0.999), 1e-8
ZENFLOW = {"topk_ratio": 0.5, "select_strategy": "step", "select_interval": 4, "update_interval": 2,
           "full_warm_up_rounds": 1}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _batch(t: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * t + rank)
    return torch.randn(2, 6, generator=gen), torch.randn(2, 4, generator=gen)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def _engine_run(stage: int, offload: bool):
    import deepspeed

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, betas=BETAS, eps=EPS)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_force_ds_cpu_optimizer": False,
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"},
                                    "zenflow": {**ZENFLOW, "offload": offload}}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    rank, history = torch.distributed.get_rank(), []
    for t in range(STEPS):
        x, y = _batch(t, rank)
        engine.backward(_loss(engine, x, y))
        engine.step()
        history.append([p.detach().clone() for p in engine.module.parameters()])
    return history


def _adamw_slice(p, g, m, v, step):
    """One AdamW step (decoupled decay, bias-corrected), the textbook formula, in place on ``p``."""
    p.mul_(1 - LR * WD)
    m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
    denom = (v.sqrt() / (1 - BETAS[1] ** step) ** 0.5).add_(EPS)
    p.addcdiv_(m, denom, value=-LR / (1 - BETAS[0] ** step))


def _selective_step(weights, grads, selection, moments, steps):
    """The selected columns (whole 1-D parameters) of each weight take one AdamW step; the rest stay."""
    for i, (w, g) in enumerate(zip(weights, grads, strict=True)):
        cols = selection[i]
        piece, gs = (w[:, cols].clone(), g[:, cols]) if cols is not None else (w.clone(), g)
        if moments[i] is None:
            moments[i] = (torch.zeros_like(piece), torch.zeros_like(piece))
        steps[i] += 1
        _adamw_slice(piece, gs, *moments[i], steps[i])
        if cols is not None:
            w[:, cols] = piece
        else:
            w.copy_(piece)


def _reference():
    model = _model()
    weights = [p.detach().clone() for p in model.parameters()]
    master = [torch.nn.Parameter(w.clone()) for w in weights]
    full = torch.optim.AdamW(master, lr=LR, weight_decay=WD, betas=BETAS, eps=EPS)
    moments = [None] * len(weights)
    steps = [0] * len(weights)
    window, history, selection = [], [], None
    w_, u_, s_ = ZENFLOW["full_warm_up_rounds"], ZENFLOW["update_interval"], ZENFLOW["select_interval"]
    for t in range(STEPS):
        grads = []
        for rank in range(2):
            with torch.no_grad():
                for p, w in zip(model.parameters(), weights, strict=True):
                    p.copy_(w)
            model.zero_grad()
            _loss(model, *_batch(t, rank)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        g = [(a + b) / 2 for a, b in zip(*grads, strict=True)]
        window.append(g)
        selective = t >= w_
        if selective and (t == w_ or (t > w_ and t % s_ == 0)):
            with torch.no_grad():
                for m, w in zip(master, weights, strict=True):
                    m.copy_(w)
            for m in moments:
                if m is not None:
                    m[0].zero_()
                    m[1].zero_()
            selection = [torch.topk(gi.abs().sum(0), int(0.5 * gi.shape[1])).indices.sort().values
                         if gi.dim() == 2 else None for gi in g]

        update = t + 1 < w_ or (t + 1 - w_) % u_ == 0 or (t + 1) % s_ == 0
        if not update:
            _selective_step(weights, g, selection, moments, steps)
        else:
            snap = [w[:, c].clone() if c is not None else w.clone()
                    for w, c in zip(weights, selection or [None] * len(weights), strict=True)] if selective else None
            for m, parts in zip(master, zip(*window, strict=True), strict=True):
                m.grad = torch.stack(parts).sum(0) / len(window)
            full.step()
            window = []
            weights = [m.detach().clone() for m in master]
            if selective:
                for w, c, s in zip(weights, selection, snap, strict=True):
                    if c is not None:
                        w[:, c] = s
                    else:
                        w.copy_(s)
                _selective_step(weights, g, selection, moments, steps)
        history.append([w.clone() for w in weights])
    return history, selection


@pytest.mark.parametrize("stage, offload", [(2, False), (1, True)])
def test_zenflow_matches_the_reference_schedule(stage, offload):
    ranks = run_distributed(_engine_run, world_size=2, args=(stage, offload), timeout=120)
    expected, selection = _reference()
    for step, (a, b) in enumerate(zip(*ranks, strict=True)):
        for pa, pb in zip(a, b, strict=True):
            assert torch.equal(pa, pb), f"ranks disagree after step {step}"
    for step, (got, want) in enumerate(zip(ranks[0], expected, strict=True)):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=2e-6, msg=f"step {step}")
    # step 5 is selective only (W=1, U=2: updates end steps 0, 2, 4, 6, and 3, 7 end select windows)
    before, after = ranks[0][4], ranks[0][5]
    for i, cols in ((0, selection[0]), (2, selection[2])):
        rest = [c for c in range(before[i].shape[1]) if c not in cols.tolist()]
        assert torch.equal(before[i][:, rest], after[i][:, rest])
        assert not torch.equal(before[i][:, cols], after[i][:, cols])


def _refusals() -> list[str]:
    import deepspeed
    from ds_config import ConfigError

    messages = []
    for zero in ({"zenflow": {"update_interval": "auto"}},
                 {"zenflow": {"update_interval": 2, "overlap_step": True}},
                 {"zenflow": {"update_interval": 2, "select_interval": 3}},
                 {"zenflow": {"update_interval": 2}, "offload_optimizer": {"device": "none"}}):
        config = {"train_micro_batch_size_per_gpu": 1, "zero_force_ds_cpu_optimizer": False,
                  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, **zero}}
        model = _model()
        try:
            deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
        except ConfigError as exc:
            messages.append(str(exc))
    return messages


def test_unbuilt_zenflow_options_are_refused_naming_the_key():
    messages = run_distributed(_refusals, world_size=1, timeout=60)[0]
    assert len(messages) == 4
    for message, (key, value) in zip(messages, [("zenflow.update_interval", "'auto'"),
                                                ("zenflow.overlap_step", "True"),
                                                ("zenflow.select_interval", "3"),
                                                ("offload_optimizer.device", "'none'")], strict=True):
        assert f"zero_optimization.{key}" in message and f"(got {value})" in message and "accepted" in message
