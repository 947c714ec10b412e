"""Stage 0's gradients as bucket views (``BucketedAllReduce``) and the fused kernel behind ``torch_adam``.

The view path must give bitwise the numbers of the copy path (``ReferenceAllReduce``): fp32 and bf16, gradient
accumulation, clipping, no_sync; and ``param.grad`` must really be the bucket's memory after the first step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

WIDTH = 16


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.GELU(), torch.nn.Linear(WIDTH, 4))


def _in_a_bucket(grad: torch.Tensor | None, reducer) -> bool:
    if grad is None:
        return False
    spans = [(b.flat.data_ptr(), b.flat.data_ptr() + b.flat.numel() * b.flat.element_size()) for b in reducer.buckets]
    return any(lo <= grad.data_ptr() < hi for lo, hi in spans)


def _train(config: dict, reference: bool, no_sync_every: int) -> tuple[list[torch.Tensor], bool]:
    import deepspeed
    from deepspeed.runtime.grad_reduce import ReferenceAllReduce

    engine, _, _, _ = deepspeed.initialize(model=_model(), config=config)
    if reference:
        params = [p for p in engine.module.parameters() if p.requires_grad]
        engine.reducer = ReferenceAllReduce(params, engine.optimizer, engine.reducer.options)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    dtype = next(engine.module.parameters()).dtype
    views = []
    for step in range(6):
        x, y = torch.randn(3, WIDTH, generator=gen).to(dtype), torch.randn(3, 4, generator=gen).to(dtype)
        if no_sync_every and step % no_sync_every == 0:
            with engine.no_sync():
                engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        if not reference and engine.is_gradient_accumulation_boundary():
            views.append(all(_in_a_bucket(p.grad, engine.reducer) for p in engine.module.parameters()))
        engine.step()
    return [p.detach().float().clone() for p in engine.module.parameters()], all(views[1:]) if views else False


def _views_match_copies(config: dict, no_sync_every: int) -> bool:
    got, viewed = _train(config, reference=False, no_sync_every=no_sync_every)
    again, _ = _train(config, reference=False, no_sync_every=no_sync_every)
    ref, _ = _train(config, reference=True, no_sync_every=no_sync_every)
    for a, b, c in zip(got, again, ref, strict=True):
        assert torch.equal(a, b), "two runs of the view path differ"
        assert torch.equal(a, c), f"view path differs from the copy path by {float((a - c).abs().max()):g}"
    return viewed


SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}


@pytest.mark.parametrize("extra,no_sync_every,expect_views", [
    ({}, 0, True),
    ({"gradient_accumulation_steps": 2, "gradient_clipping": 0.5}, 0, True),
    ({"bf16": {"enabled": True}}, 0, True),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, 0, False),
    ({"prescale_gradients": True}, 3, True),
])
def test_bucket_views_bitwise_equal_copy_path(extra, no_sync_every, expect_views):
    config = {"train_micro_batch_size_per_gpu": 3, "optimizer": SGD, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 0}, **extra}
    config.setdefault("gradient_accumulation_steps", 1)
    results = run_distributed(_views_match_copies, world_size=2, args=(config, no_sync_every), timeout=120)
    assert all(viewed == expect_views for viewed in results)


def test_torch_adam_uses_fused_kernel_with_the_same_numbers():
    from deepspeed.runtime.engine._optimizer import _adam

    for name, extra, cls in (("adam", {}, torch.optim.AdamW), ("adamw", {}, torch.optim.AdamW),
                             ("adam", {"adam_w_mode": False}, torch.optim.Adam)):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
        plain = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = _adam(params, {"torch_adam": True, "lr": 1e-2, "weight_decay": 0.1, **extra}, name,
                    cpu_offload=False)
        assert opt.defaults["fused"] is True
        assert type(opt) is cls
        ref = cls(plain, lr=1e-2, weight_decay=0.1, foreach=False)
        for step in range(5):
            for p, q in zip(params, plain, strict=True):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
                q.grad = p.grad.clone()
            opt.step()
            ref.step()
        for p, q in zip(params, plain, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # a config that chose the implementation keeps it
    explicit = _adam([torch.nn.Parameter(torch.zeros(2))], {"torch_adam": True, "foreach": True}, "adam", False)
    assert explicit.defaults["foreach"] is True and not explicit.defaults["fused"]
