"""DeepSpeed's stage-0 fp16/bf16 optimizer classes save DeepSpeed's state-dict layout (``cur_scale``, ``fp32_groups``
or ``fp32_groups_flat``), so real DeepSpeed loads our checkpoints, and load it back, so a DeepSpeed checkpoint's
fp32 master weights are restored exactly rather than rebuilt from the 16-bit weights."""

from __future__ import annotations

import pytest
import torch

from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer


def _wrapped(cls, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(torch.bfloat16)
    opt = cls(torch.optim.AdamW(model.parameters(), lr=0.1), low_precision_dtype=torch.bfloat16)
    for _ in range(2):
        opt.backward(model(torch.randn(5, 4, dtype=torch.bfloat16)).float().pow(2).sum())
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize(("cls", "key"), [(FP16_UnfusedOptimizer, "fp32_groups"),
                                          (FP16_Optimizer, "fp32_groups_flat")])
def test_saves_deepspeeds_keys_and_restores_masters_from_them(cls, key):
    _, opt = _wrapped(cls)
    state = opt.state_dict()
    assert {"dynamic_loss_scale", "cur_scale", "cur_iter", "optimizer_state_dict", key} <= set(state)
    assert state["dynamic_loss_scale"] is False and state["cur_scale"] == 1.0
    masters = [opt.master_of[p].detach().clone() for p in opt.model_params]
    # ours' model-order masters share the DeepSpeed layout's storage: nothing is written twice
    ours = {t.untyped_storage().data_ptr() for t in state["fp32_master_weights"]}
    theirs = {t.untyped_storage().data_ptr() for t in (state[key] if key == "fp32_groups_flat"
                                                        else [m for g in state[key] for m in g])}
    assert ours <= theirs
    deepspeed_layout = {k: v for k, v in state.items() if k not in ("fp32_master_weights", "loss_scaler")}
    model2, other = _wrapped(cls, seed=1)
    assert not all(torch.equal(other.master_of[p], m) for p, m in zip(other.model_params, masters, strict=True))
    other.load_state_dict(deepspeed_layout)
    assert all(torch.equal(other.master_of[p], m) for p, m in zip(other.model_params, masters, strict=True))
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(other.model_params, masters, strict=True))


def test_masters_that_do_not_fit_are_refused():
    _, opt = _wrapped(FP16_UnfusedOptimizer)
    state = opt.state_dict()
    state.pop("fp32_master_weights")
    state["fp32_groups"] = [state["fp32_groups"][0][:-1]]
    with pytest.raises(ValueError, match="do not fit this model's trainable parameters"):
        _wrapped(FP16_UnfusedOptimizer, seed=1)[1].load_state_dict(state)
