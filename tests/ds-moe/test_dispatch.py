"""The indexed dispatch/combine (default) agrees with DeepSpeed's dense einsum reference: outputs and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ds_moe import MoE
from ds_moe._dispatch import combine_einsum, combine_indexed, dispatch_einsum, dispatch_indexed
from ds_moe._gating import top1_routing, top2_routing
from ds_moe._routing import dense_combine_weights


def _expert(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))


def _run(layer: MoE, mode: str, x: torch.Tensor, seed: int):
    layer.deepspeed_moe.dispatch_mode = mode
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out, l_aux, counts = layer(x)
    weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    ((out * weight).sum() + 0.1 * l_aux).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), l_aux.detach(), counts, x.grad, grads


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize(("drop_tokens", "capacity_factor"), [(True, 0.5), (True, 1.5), (False, 1.0)])
@pytest.mark.parametrize("use_residual", [False, True])
def test_indexed_and_einsum_dispatch_agree_forward_and_backward(k, drop_tokens, capacity_factor, use_residual):
    torch.manual_seed(0)
    layer = MoE(8, _expert(8), num_experts=4, k=k, capacity_factor=capacity_factor, min_capacity=1,
                drop_tokens=drop_tokens, use_residual=use_residual)
    x = torch.randn(3, 10, 8) * 2
    dense = _run(layer, "einsum", x, seed=42)
    fast = _run(layer, "indexed", x, seed=42)
    torch.testing.assert_close(fast[0], dense[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast[1], dense[1])
    assert torch.equal(fast[2], dense[2])
    torch.testing.assert_close(fast[3], dense[3], rtol=1e-5, atol=1e-6)
    assert fast[4].keys() == dense[4].keys() and "deepspeed_moe.gate.wg.weight" in fast[4]
    for name in dense[4]:
        torch.testing.assert_close(fast[4][name], dense[4][name], rtol=1e-5, atol=1e-6, msg=name)


def test_default_dispatch_is_indexed_and_unknown_modes_are_rejected():
    layer = MoE(4, nn.Linear(4, 4), num_experts=2)
    assert layer.deepspeed_moe.dispatch_mode == "indexed"
    with pytest.raises(ValueError, match=r"'sorted'.*'indexed', 'einsum'"):
        layer.deepspeed_moe.dispatch_mode = "sorted"


@pytest.mark.parametrize("k", [1, 2])
def test_dispatch_primitives_fill_the_same_buffers(k):
    logits = torch.randn(20, 4) * 3
    routing = (top1_routing(logits, 1.0, 1, use_rts=False) if k == 1
               else top2_routing(logits, 1.0, 1, top2_2nd_expert_sampling=False))
    combine_weights, dispatch_mask = dense_combine_weights(routing)
    tokens = torch.randn(20, 6)
    buffers = dispatch_indexed(tokens, routing)
    assert torch.equal(buffers, dispatch_einsum(tokens, dispatch_mask))
    expert_out = torch.randn_like(buffers)
    torch.testing.assert_close(combine_indexed(expert_out, routing), combine_einsum(expert_out, combine_weights))


def test_a_gate_without_route_uses_the_dense_path():
    """A DeepSpeed-style custom gate that only returns dense weights still works."""
    torch.manual_seed(0)
    layer = MoE(6, _expert(6), num_experts=2, min_capacity=1, use_rts=False)
    inner = layer.deepspeed_moe.gate

    class DenseOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.g = copy.deepcopy(inner)

        def forward(self, x, used_token=None):
            return self.g(x, used_token)

        def _set_ep_group(self, group):
            pass

    x = torch.randn(12, 6)
    want = layer(x)[0]
    layer.deepspeed_moe.gate = DenseOnly()
    torch.testing.assert_close(layer(x)[0], want)
