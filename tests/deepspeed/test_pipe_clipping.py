"""Gradient clipping of a pipeline without ZeRO: the norm is over every stage's gradients; bf16 gradients are
clipped in bf16, as DeepSpeed's pipeline ``BF16_Optimizer`` does.

fp32: two gloo ranks, two stages, one optimizer step of SGD over ``GAS`` micro-batches, against a hand-computed
one-process reference: the mean of the micro-batch gradients, its L2 norm over the whole model, the clip factor
``clip / (norm + 1e-6)`` and ``w - lr * factor * grad``. The clip value sits between the first stage's norm and
the whole model's, so this also pins the documented deviation from DeepSpeed (docs/deviations.md, "Pipeline"):
DeepSpeed's fp32 path counts only the first stage's gradients and would not clip here at all.
"""

from __future__ import annotations

import math

import pytest
import torch
from _harness import run_distributed
from _pipe_models import build_reference, mlp_batches, mlp_specs
from torch import nn

GAS, LR = 2, 0.5


def _one_step(clip: float) -> dict:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": clip}
    module = PipelineModule(mlp_specs(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True)
    engine, *_ = deepspeed.initialize(model=module, config=config)
    loss = float(engine.train_batch(iter(mlp_batches(GAS))))
    return {"loss": loss, "norm": engine.get_global_grad_norm(), "parts": list(module.parts),
            "params": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def _reference() -> tuple[float, dict, dict]:
    """(mean loss, weights before the step, mean gradients) of the whole model in one process."""
    holder, funcs = build_reference(mlp_specs())
    total = 0.0
    for x, y in mlp_batches(GAS):
        for f in funcs:
            x = f(x)
        loss = nn.functional.mse_loss(x, y)
        (loss / GAS).backward()
        total += float(loss.detach()) / GAS
    weights = {k: v.detach().clone() for k, v in holder.state_dict().items()}
    grads = {name: p.grad.clone() for name, p in holder.named_parameters()}
    return total, weights, grads


def _norm(grads: dict, names) -> float:
    return math.sqrt(sum(float(grads[n].double().pow(2).sum()) for n in names))


@pytest.mark.parametrize("clip", [0.0, 0.3], ids=["no-clip", "clip"])
def test_clip_norm_spans_every_stage(clip):
    got = run_distributed(_one_step, world_size=2, args=(clip,), timeout=120)
    loss, weights, grads = _reference()
    full = _norm(grads, grads)
    boundary = got[0]["parts"][1]
    first_stage = _norm(grads, [n for n in grads if int(n.split(".")[0]) < boundary])
    assert first_stage < 0.3 < full  # the case where counting only the first stage would not clip
    factor = clip / (full + 1e-6) if 0 < clip < full else 1.0
    for rank, r in enumerate(got):
        assert r["loss"] == pytest.approx(loss, rel=1e-6)  # the mean over micro-batches, on every stage
        if clip > 0:
            assert r["norm"] == pytest.approx(full, rel=1e-5)
        assert r["params"], f"rank {rank} holds no parameters"
        for name, value in r["params"].items():
            expected = weights[name] - LR * factor * grads[name]
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-7, msg=f"rank {rank}: {name}")


def _bf16_grads(clip: float) -> list[torch.Tensor]:
    """The gradients the torch optimizer receives at the first step of a bf16 pipeline (bf16 accumulation)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": clip, "bf16": {"enabled": True}}
    module = PipelineModule(mlp_specs(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True)
    engine, *_ = deepspeed.initialize(model=module, config=config)
    seen, torch_step = [], engine.optimizer.optimizer.step

    def recording_step(*args, **kwargs):
        seen.extend(p.grad.clone() for group in engine.optimizer.optimizer.param_groups for p in group["params"])
        return torch_step(*args, **kwargs)

    engine.optimizer.optimizer.step = recording_step
    engine.train_batch(iter([(x.bfloat16(), y.bfloat16()) for x, y in mlp_batches(GAS)]))
    return seen


def test_bf16_gradients_are_clipped_in_bf16():
    clip = 0.05
    plain = run_distributed(_bf16_grads, world_size=2, args=(0.0,), timeout=120)
    clipped = run_distributed(_bf16_grads, world_size=2, args=(clip,), timeout=120)
    # the norm as DeepSpeed sums it: float32 squares of each stage's float32 norms, the stages' sums added
    sums = [torch.zeros((), dtype=torch.float32) for _ in plain]
    for rank, grads in enumerate(plain):
        for g in grads:
            sums[rank].add_(g.norm(2.0) ** 2.0)
    norm = (sums[0] + sums[1]).pow(0.5)
    coef = clip / (norm + 1e-6)
    assert coef < 1  # clipping fires
    for rank in range(2):
        assert len(clipped[rank]) == len(plain[rank]) > 0
        for g, got in zip(plain[rank], clipped[rank], strict=True):
            assert torch.equal(g, g.bfloat16().float())  # bf16 accumulation: bf16 values
            expected = (g.bfloat16() * coef).float()  # scaled in bf16, then handed over in fp32
            assert torch.equal(got, expected), f"rank {rank}: {(got - expected).abs().max()}"
