"""A NaN or inf gradient on one rank of a 2-rank ZeRO-1 job under fp16 and bf16.

fp16 (dynamic loss scaling, hysteresis 1): the step is skipped on both ranks, the loss scale halves on both,
every parameter stays bitwise as it was, and the next clean step trains on. bf16 with the default
``check_grad_overflow`` (True, as in DeepSpeed 0.19; it was False here, and one NaN gradient then turned every
weight into NaN without a word): the same skip, no loss scale involved. The ranks never differ.
"""

from __future__ import annotations

import math

import pytest
import torch
from _harness import run_distributed
from _sibling import load_sibling

_job = load_sibling(__file__, "_job.py", "_faults_job")
_record = load_sibling(__file__, "_record.py", "_faults_record")

PRECISIONS = {
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 1}},
    "bf16": {"bf16": {"enabled": True}},  # check_grad_overflow left to its default (True, as DeepSpeed 0.19)
}


def _poisoned_step(precision: str, value: float) -> dict:
    engine = _job.build_engine(config=dict(_job.CONFIG, **PRECISIONS[precision]))
    _job.train(engine, 2)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    scale_before = engine.get_loss_scale()
    poison = torch.distributed.get_rank() == 1
    handle = engine.module[2].weight.register_hook(lambda g: torch.full_like(g, value) if poison else g)
    _job.train(engine, 1)
    handle.remove()
    after = engine.module.state_dict()
    unchanged = all(torch.equal(v, before[k]) for k, v in after.items())
    finite = all(torch.isfinite(v).all() for v in after.values())
    result = {"applied": engine.was_step_applied(), "skipped": engine.skipped_steps, "unchanged": unchanged,
              "finite": finite, "scale": (scale_before, engine.get_loss_scale()), "steps": engine.global_steps}
    _job.train(engine, 1)  # a clean step after the skipped one trains (no NaN kept in any buffer)
    result["trains_on"] = engine.was_step_applied() and not all(
        torch.equal(v, before[k]) for k, v in engine.module.state_dict().items())
    result["params"] = {k: v.float() for k, v in engine.module.state_dict().items()}
    return result


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(precision, value):
    results = run_distributed(_poisoned_step, world_size=2, args=(precision, value), timeout=120)
    for rank, r in enumerate(results):
        assert r["applied"] is False and r["skipped"] == 1, (rank, r)
        assert r["unchanged"] and r["finite"], f"rank {rank}: the poisoned step changed the parameters"
        assert r["trains_on"], f"rank {rank}: the step after the skipped one did not train"
        if precision == "fp16":
            assert r["scale"][1] < r["scale"][0], r["scale"]
    assert results[0]["scale"] == results[1]["scale"]
    for name, value_ in results[0]["params"].items():
        assert torch.equal(value_, results[1]["params"][name]), name
    scale = f"loss scale {results[0]['scale'][0]:g} -> {results[0]['scale'][1]:g} on both ranks; " \
        if precision == "fp16" else ""
    _record.record(f"{value} gradient on rank 1 under {precision}",
                   f"step skipped on both ranks (was_step_applied() False, skipped_steps 1); {scale}training goes on",
                   None, "no exit: the step is skipped",
                   "parameters bitwise unchanged on both ranks; the next clean step trains")
