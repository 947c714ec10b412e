"""DeepSpeed's sparse route format (``sparse_routes=True``) and its encode/decode helpers agree with the dense
``[S, E, C]`` gate output, and ``TopKGate`` takes ``k > 2`` as DeepSpeed's gate does."""

from __future__ import annotations

import pytest
import torch

from ds_moe import TopKGate
from ds_moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode, top1gating, top2gating, topkgating


def _gates(k: int, logits: torch.Tensor, factor: float):
    if k == 1:
        return top1gating(logits, factor, 0, use_rts=False), top1gating(logits, factor, 0, use_rts=False,
                                                                        sparse_routes=True)
    if k == 2:
        return (top2gating(logits, factor, 0, top2_2nd_expert_sampling=False),
                top2gating(logits, factor, 0, top2_2nd_expert_sampling=False, sparse_routes=True))
    return topkgating(logits, k, factor, 0), topkgating(logits, k, factor, 0, sparse_routes=True)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("factor", [0.5, 1.0])  # 0.5: some routes are dropped
def test_sparse_routes_encode_and_decode_like_the_dense_einsums(k, factor):
    torch.manual_seed(k)
    tokens, experts, width = 16, 4, 8
    logits, hidden = torch.randn(tokens, experts), torch.randn(tokens, width)
    dense, sparse = _gates(k, logits, factor)
    l_aux, cap, num_experts, indices, locations, gates, counts = sparse
    assert indices.shape == (k, tokens) and indices.dtype == torch.int32 and locations.dtype == torch.int32
    assert num_experts == experts and torch.equal(l_aux, dense[0]) and torch.equal(counts, dense[3])
    cap = int(cap)
    assert cap == dense[1].shape[-1]
    dropped = indices < 0
    assert bool(dropped.any()) == (int(dense[2].sum()) < k * tokens)
    assert torch.all(gates[dropped] == 0) and torch.all(locations[dropped] == 0)
    slots = _route_slots(indices, locations, experts, cap)
    assert torch.all(slots[dropped] == experts * cap)
    expected = torch.einsum("sec,sm->ecm", dense[2].float(), hidden)
    assert torch.equal(_sparse_encode(hidden, slots, experts, cap), expected)
    out = torch.randn_like(expected)
    combined = _sparse_decode(out.view(experts * cap, width), slots, gates, tokens)
    torch.testing.assert_close(combined, torch.einsum("sec,ecm->sm", dense[1], out))


def test_sparse_decode_accumulates_in_fp32_and_returns_the_output_dtype():
    slots = torch.tensor([[0, 1], [1, 2]])  # token 1 gets two routes; slot 2 is the empty scratch slot
    gates = torch.tensor([[1.0, 0.5], [0.0, 0.25]])
    out = torch.tensor([[3.0], [2.0]], dtype=torch.bfloat16)
    got = _sparse_decode(out, slots, gates, 2)
    assert got.dtype == torch.bfloat16 and got.flatten().tolist() == [3.0, 1.0]


def test_gate_forward_sparse_and_k3():
    torch.manual_seed(0)
    gate = TopKGate(6, 4, k=3, min_capacity=1)
    x = torch.randn(10, 6)
    dense = gate(x)
    torch.manual_seed(0)
    sparse = gate(x, None, True)
    assert dense[1].shape[:2] == (10, 4) and sparse[3].shape == (3, 10)
    assert torch.all((sparse[3] >= 0).sum(0) == dense[2].flatten(1).sum(1))  # kept routes per token agree
