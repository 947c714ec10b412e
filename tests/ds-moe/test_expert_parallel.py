"""Expert parallelism over gloo equals one process holding every expert: outputs, l_aux, input, router and expert
gradients. Each rank feeds its own tokens; local expert i on expert-parallel rank r is global expert
r * num_local + i, so its gradient is the sum over the tokens of every rank in its expert-parallel group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from torch import nn

from ds_moe import MoE

HIDDEN, EXPERTS, TOKENS = 8, 4, (2, 6)
PREFIX = "deepspeed_moe.experts.deepspeed_experts."


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))


def _layer(ep_size: int, k: int, mode: str) -> MoE:
    layer = MoE(HIDDEN, _expert(), num_experts=EXPERTS, ep_size=ep_size, k=k, min_capacity=1, drop_tokens=False,
                top2_2nd_expert_sampling=False)
    layer.deepspeed_moe.dispatch_mode = mode
    return layer


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(*TOKENS, HIDDEN, generator=torch.Generator().manual_seed(100 + rank)) * 2


def _step(layer: MoE, x: torch.Tensor) -> dict:
    x = x.clone().requires_grad_(True)
    out, l_aux, counts = layer(x)
    weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    ((out * weight).sum() + l_aux).backward()
    return {"out": out.detach(), "l_aux": l_aux.detach(), "counts": counts, "x_grad": x.grad,
            "grads": {n: p.grad.clone() for n, p in layer.named_parameters()}}


def _global_name(name: str, ep_rank: int, num_local: int) -> str:
    if not name.startswith(PREFIX):
        return name
    local, rest = name[len(PREFIX):].split(".", 1)
    return f"{PREFIX}{ep_rank * num_local + int(local)}.{rest}"


def _expert_parallel_rank(state: dict, ep_size: int, k: int, mode: str) -> dict:
    layer = _layer(ep_size, k, mode)
    layer.set_deepspeed_parallelism()
    ep_rank = dist.get_rank(group=layer.deepspeed_moe.ep_group)
    layer.load_state_dict({n: state[_global_name(n, ep_rank, layer.num_local_experts)]
                           for n in layer.state_dict()})
    result = _step(layer, _inputs(dist.get_rank()))
    result["grads"] = {_global_name(n, ep_rank, layer.num_local_experts): g for n, g in result["grads"].items()}
    return result


@pytest.mark.parametrize(("world", "ep_size", "k", "mode"), [
    (2, 2, 1, "indexed"), (2, 2, 2, "indexed"), (2, 2, 1, "einsum"), (4, 2, 2, "indexed"), (4, 4, 1, "indexed"),
], ids=["w2ep2-top1", "w2ep2-top2", "w2ep2-top1-einsum", "w4ep2-top2", "w4ep4-top1"])
def test_expert_parallel_matches_single_process(world, ep_size, k, mode):
    torch.manual_seed(0)
    reference = _layer(1, k, mode)
    state = {n: t.clone() for n, t in reference.state_dict().items()}
    got = run_distributed(_expert_parallel_rank, world_size=world, args=(state, ep_size, k, mode), timeout=60)
    want = []
    for rank in range(world):
        reference.zero_grad(set_to_none=True)
        want.append(_step(reference, _inputs(rank)))
    for rank in range(world):
        g, w = got[rank], want[rank]
        torch.testing.assert_close(g["out"], w["out"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g["l_aux"], w["l_aux"])
        assert torch.equal(g["counts"], w["counts"])
        torch.testing.assert_close(g["x_grad"], w["x_grad"], rtol=1e-5, atol=1e-6)
        block = range(rank - rank % ep_size, rank - rank % ep_size + ep_size)  # this rank's EP group
        assert set(g["grads"]) >= {"deepspeed_moe.gate.wg.weight"}
        for name, grad in g["grads"].items():
            if name.startswith(PREFIX):  # an expert's gradient sums the tokens of its whole EP group
                expected = sum(want[r]["grads"][name] for r in block)
            else:  # the router's gradient is this rank's own (data-parallel averaging is the engine's job)
                expected = w["grads"][name]
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")
    owned = {n for g in got[:ep_size] for n in g["grads"] if n.startswith(PREFIX)}
    assert owned == {n for n in want[0]["grads"] if n.startswith(PREFIX)}  # every global expert is somewhere
