"""DeepSpeedCPUAdam's sub-group interface (DeepSpeed's ``step_subgroup`` / ``rollback_subgroup``): moments kept
per sub-group id, and a rollback that undoes a step."""

from __future__ import annotations

import pytest
import torch

from ds_ops.adam import DeepSpeedCPUAdam


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_rollback_undoes_steps(adamw_mode):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(257))
    opt = DeepSpeedCPUAdam([param], lr=0.01, weight_decay=0.1, adamw_mode=adamw_mode, allow_torch_fallback=True)
    param.grad = torch.randn(257)
    history = [param.detach().clone()]
    for _ in range(3):
        opt.step_subgroup(0)
        history.append(param.detach().clone())
    moments = opt.state[0]["exp_avg"].clone()
    assert opt.state[0]["step"] == 3 and not torch.equal(history[-1], history[0])
    for step in (2, 1, 0):
        opt.rollback_subgroup(0)
        assert opt.state[0]["step"] == step
        torch.testing.assert_close(param.detach(), history[step], rtol=0, atol=1e-5)
    assert opt.state[0]["exp_avg"].abs().max() < 1e-5 < moments.abs().max()


def test_sub_groups_are_independent_and_errors_name_the_sub_group():
    param = torch.nn.Parameter(torch.randn(64))
    opt = DeepSpeedCPUAdam([param], allow_torch_fallback=True)
    param.grad = torch.randn(64)
    with pytest.raises(RuntimeError, match="sub_group_id 0 as it has not been initialized"):
        opt.rollback_subgroup(0)
    opt.step_subgroup(0)
    opt.step_subgroup(1)
    opt.step_subgroup(0)
    assert (opt.state[0]["step"], opt.state[1]["step"]) == (2, 1)
    opt.rollback_subgroup(1)
    with pytest.raises(RuntimeError, match="Cannot rollback sub_group_id 1: step count is 0"):
        opt.rollback_subgroup(1)


def test_the_same_step_on_two_sub_groups_is_bit_identical():
    base = torch.randn(128)
    a, b = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
    opt = DeepSpeedCPUAdam([a], allow_torch_fallback=True)
    for _ in range(3):
        grad = torch.randn(128)
        for sub, p in ((0, a), (1, b)):
            opt.param_groups[0]["params"] = [p]
            p.grad = grad.clone()
            opt.step_subgroup(sub)
        assert torch.equal(a, b) and torch.equal(opt.state[0]["exp_avg_sq"], opt.state[1]["exp_avg_sq"])
