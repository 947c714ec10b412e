"""``MoE`` and ``Experts`` in one process: construction, attributes the engine reads, forward semantics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_moe import Experts, MoE


def _expert(hidden: int = 6) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, 12), nn.ReLU(), nn.Linear(12, hidden))


def test_experts_are_deep_copies_marked_for_the_expert_group():
    proto = _expert()
    experts = Experts(proto, num_local_experts=3, expert_group_name="ep_size_2")
    assert len(experts.deepspeed_experts) == 3 and experts.num_local_experts == 3
    seen = set()
    for e in experts.deepspeed_experts:
        for (name, p), (_, q) in zip(e.named_parameters(), proto.named_parameters(), strict=True):
            assert p is not q and torch.equal(p, q), name
            assert p.allreduce is False and p.group_name == "ep_size_2"
            seen.add(id(p))
    assert len(seen) == 3 * 4
    assert not hasattr(next(proto.parameters()), "allreduce")  # the prototype itself is left alone


def test_experts_forward_gives_local_expert_i_the_slice_i():
    torch.manual_seed(0)
    experts = Experts(_expert(), num_local_experts=2)
    x = torch.randn(3, 2, 5, 6)  # [G source ranks, local experts, capacity, model]
    out = experts(x)
    assert out.shape == x.shape
    for i in range(2):
        torch.testing.assert_close(out[:, i], experts.deepspeed_experts[i](x[:, i]))


def test_tuple_returning_expert_contributes_its_first_element():
    class WithBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x), self.lin.bias

    experts = Experts(WithBias(), 2)
    assert experts(torch.randn(1, 2, 3, 4)).shape == (1, 2, 3, 4)


def test_moe_attributes_names_and_state_dict_keys():
    layer = MoE(6, _expert(), num_experts=8, ep_size=4, k=2)
    assert layer.expert_group_name == "ep_size_4" and layer.num_experts == 8 and layer.num_local_experts == 2
    assert layer.ep_size == 4 and not layer.use_residual and not layer.enable_expert_tensor_parallelism
    moe = layer.deepspeed_moe
    assert (moe.ep_size, moe.ep_group_name, moe.num_local_experts, moe.ep_group) == (4, "ep_size_4", 2, None)
    assert moe.gate.k == 2 and moe.gate.min_capacity == 4 and moe.gate.capacity_factor == 1.0
    keys = set(layer.state_dict())
    assert "deepspeed_moe.gate.wg.weight" in keys and "deepspeed_moe.experts.deepspeed_experts.1.2.bias" in keys
    gate_param = layer.deepspeed_moe.gate.wg.weight
    assert not hasattr(gate_param, "allreduce")  # the router is an ordinary (data-parallel) parameter


@pytest.mark.parametrize(("kwargs", "words"), [
    (dict(num_experts=6, ep_size=4), ["(6)", "ep_size=4"]),
    (dict(num_experts=4, k=5), ["k=5", "num_experts (4)"]),
    (dict(num_experts=4, noisy_gate_policy="jitter"), ["'jitter'", "'Jitter'", "'RSample'", "None"]),
    (dict(num_experts=0), ["num_experts", "0"]),
])
def test_bad_arguments_are_value_errors_naming_them(kwargs, words):
    with pytest.raises(ValueError) as err:
        MoE(6, _expert(), **kwargs)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_forward_shapes_loss_and_counts():
    torch.manual_seed(0)
    layer = MoE(6, _expert(), num_experts=4, min_capacity=1)
    out, l_aux, counts = layer(torch.randn(2, 8, 6))
    assert out.shape == (2, 8, 6) and l_aux.dim() == 0 and counts.tolist() and counts.sum().item() == 16
    assert layer.deepspeed_moe.l_aux is l_aux and layer.deepspeed_moe.exp_counts is counts


def test_used_token_leaves_masked_tokens_with_zero_output():
    torch.manual_seed(0)
    layer = MoE(6, _expert(), num_experts=2, min_capacity=1, drop_tokens=False)
    used = torch.tensor([1, 1, 0, 1, 0, 1, 1, 1])
    out, _, counts = layer(torch.randn(8, 6), used_token=used)
    assert (out[used == 0] == 0).all() and (out[used == 1].abs().sum(dim=1) > 0).all()
    assert counts.sum().item() == 6


def test_residual_moe_mixes_expert_and_mlp_by_the_learned_coefficient():
    torch.manual_seed(0)
    dense = _expert()
    layer = MoE(6, dense, num_experts=2, min_capacity=1, use_residual=True)
    assert layer.mlp is dense and tuple(layer.coefficient.weight.shape) == (2, 6)
    assert not hasattr(dense.weight if hasattr(dense, "weight") else dense[0].weight, "allreduce")
    x = torch.randn(10, 6)
    torch.manual_seed(1)
    out, _, _ = layer(x)
    torch.manual_seed(1)
    moe_out = layer.deepspeed_moe(x)
    coef = F.softmax(layer.coefficient(x), dim=-1)
    torch.testing.assert_close(out, moe_out * coef[..., 0:1] + dense(x) * coef[..., 1:])


def test_use_tutel_without_tutel_warns_and_uses_the_builtin_path():
    with pytest.warns(RuntimeWarning, match="Tutel"):
        layer = MoE(6, _expert(), num_experts=2, min_capacity=1, use_tutel=True)
    assert layer.deepspeed_moe.use_tutel is False
    assert layer(torch.randn(4, 6))[0].shape == (4, 6)


def test_expert_parallel_forward_without_groups_says_what_to_call():
    layer = MoE(6, _expert(), num_experts=4, ep_size=2, min_capacity=1)
    with pytest.raises(RuntimeError, match="set_deepspeed_parallelism"):
        layer(torch.randn(4, 6))


def test_eval_uses_eval_capacity_factor():
    layer = MoE(6, _expert(), num_experts=2, capacity_factor=1.0, eval_capacity_factor=3.0, min_capacity=1)
    x = torch.randn(8, 6)
    layer(x)
    train_cap = layer.deepspeed_moe.gate.route(x).capacity
    layer.eval()
    assert (train_cap, layer.deepspeed_moe.gate.route(x).capacity) == (4, 12)


def test_wall_clock_breakdown_records_milliseconds():
    layer = MoE(6, _expert(), num_experts=2, min_capacity=1)
    layer.deepspeed_moe.wall_clock_breakdown = layer.deepspeed_moe.gate.wall_clock_breakdown = True
    layer(torch.randn(8, 6))
    assert layer.deepspeed_moe.time_moe > 0 and layer.deepspeed_moe.gate.gate_time > 0
