"""Gradient clipping of a pipeline trained in fp32 (no ZeRO): the norm is over every stage's gradients.

Two gloo ranks, two stages, one optimizer step of SGD over ``GAS`` micro-batches, against a hand-computed
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
