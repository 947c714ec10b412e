"""``ds_moe.utils``: expert-parameter detection and DeepSpeed's MoE optimizer parameter groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_moe import (
    MoE,
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    is_moe_param_group,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)


def _param(n: int, group: str | None = None) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(n))
    if group is not None:
        p.allreduce, p.group_name = False, group
    return p


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), MoE(4, nn.Linear(4, 4), num_experts=2))


def test_is_moe_param_reads_the_allreduce_marker():
    plain, expert = _param(2), _param(2, "ep_size_1")
    flagged_true = _param(2)
    flagged_true.allreduce = True
    assert (is_moe_param(plain), is_moe_param(expert), is_moe_param(flagged_true)) == (False, True, False)


def test_has_moe_layers():
    assert has_moe_layers(_model()) == (True, 2)
    assert has_moe_layers(nn.Linear(2, 2)) == (False, 0)


def test_split_shared_and_expert_params_and_grads():
    model = _model()
    shared, expert = split_params_into_shared_and_expert_params(list(model.parameters()))
    assert len(expert) == 4 and all(is_moe_param(p) for p in expert)
    assert len(shared) == 3 and not any(is_moe_param(p) for p in shared)  # linear w+b, router weight
    model[1](torch.randn(4, 4))[0].sum().backward()
    model[1].deepspeed_moe.gate.wg.weight.grad = None
    g_shared, g_expert = split_params_grads_into_shared_and_expert_params(list(model.parameters()))
    assert g_shared == [] and len(g_expert) == 4  # only params holding a gradient


def test_split_into_moe_groups_for_optimizer():
    dense, a1, a2, b1 = _param(3), _param(5, "ep_size_2"), _param(7, "ep_size_2"), _param(2, "ep_size_4")
    groups = [{"params": [dense, a1, b1, a2], "name": "main", "lr": 0.1}, {"params": [_param(1)], "name": "other"}]
    out = split_params_into_different_moe_groups_for_optimizer(groups)
    assert out is groups  # a list is extended in place, as DeepSpeed does
    assert [(g["name"], g.get("moe", False), [p.numel() for p in g["params"]]) for g in out] == [
        ("main", False, [3]), ("other", False, [1]), ("ep_size_2", True, [5, 7]), ("ep_size_4", True, [2])]
    assert all(g["lr"] == 0.1 for g in out[2:]) and is_moe_param_group(out[2]) and not is_moe_param_group(out[0])


def test_moe_groups_are_split_by_max_group_size():
    params = [_param(n, "ep_size_1") for n in (4, 4, 3, 10, 1)]
    out = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "g"}, max_group_size=8)
    assert [[p.numel() for p in g["params"]] for g in out[1:]] == [[4, 4], [3], [10], [1]]
    unsplit = split_params_into_different_moe_groups_for_optimizer(
        ({"params": [_param(n, "ep_size_1") for n in (4, 4, 3)], "name": "g"},), max_group_size=None)
    assert [len(g["params"]) for g in unsplit] == [0, 3]


def test_groups_without_moe_params_are_returned_unchanged_and_unnamed_groups_fail():
    groups = [{"params": [_param(2)]}]
    assert split_params_into_different_moe_groups_for_optimizer(groups) == groups
    with pytest.raises(ValueError, match="'name'"):
        split_params_into_different_moe_groups_for_optimizer([{"params": [_param(2, "ep_size_1")]}])
    with pytest.raises(ValueError, match="Unknown param group type"):
        split_params_into_different_moe_groups_for_optimizer("params")


def test_configure_moe_param_groups():
    model = _model()
    out = configure_moe_param_groups(list(model.parameters()))
    assert [(g["name"], g.get("moe", False), len(g["params"])) for g in out] == [
        ("dense-params", False, 3), ("ep_size_1", True, 4)]
    assert configure_moe_param_groups(out) is out  # MoE groups already present
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        configure_moe_param_groups([1])
