"""Expert-parallel inference: a model with a DeepSpeed MoE layer, its experts split over 2 gloo ranks (ep_size 2),
loads a one-rank checkpoint and gives the one-rank model's outputs; bad ``moe`` settings are clear errors."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from _inference_models import tiny_gpt2
from torch import nn

from ds_inference import init_inference

DIM, EXPERTS = 8, 4


class MoENet(nn.Module):
    """Linear -> MoE (4 experts, top-1, no dropped tokens) -> Linear."""

    def __init__(self, ep_size: int, seed: int = 0, residual: bool = False) -> None:
        super().__init__()
        from ds_moe.layer import MoE

        torch.manual_seed(seed)
        self.inp = nn.Linear(DIM, DIM)
        expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.moe = MoE(DIM, expert, num_experts=EXPERTS, ep_size=ep_size, drop_tokens=False, min_capacity=0,
                       use_residual=residual)
        for i, e in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):  # experts differ from each other
            torch.manual_seed(seed * 100 + i)
            for p in e.parameters():
                p.data.normal_(0, 0.5)
        self.out = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(torch.tanh(self.inp(x)))[0])


@torch.no_grad()
def _ep2_matches_one_rank(path: str) -> list[int]:
    rank = dist.get_rank()
    reference = MoENet(ep_size=1).eval()
    if rank == 0:
        torch.save(reference.state_dict(), path)
    dist.barrier()
    # another seed: every weight the ep model uses must come from the checkpoint, experts by global index
    engine = init_inference(MoENet(ep_size=2, seed=7), checkpoint=path, dtype=torch.float,
                            moe={"ep_size": 2, "moe_experts": [EXPERTS], "type": "standard"})
    layer = engine.module.moe
    assert layer.num_local_experts == 2 and dist.get_world_size(layer.deepspeed_moe.ep_group) == 2
    x = torch.randn(12, DIM, generator=torch.Generator().manual_seed(rank))  # each rank its own tokens
    torch.testing.assert_close(engine(x), reference(x), rtol=1e-5, atol=1e-5)
    counts = layer(torch.tanh(engine.module.inp(x)))[2]
    return counts.tolist()


def test_expert_parallel_inference_equals_the_one_rank_model(tmp_path):
    counts = run_distributed(_ep2_matches_one_rank, world_size=2, args=(str(tmp_path / "moe.pt"),), timeout=120)
    assert all(len(c) == EXPERTS and sum(c) == 12 for c in counts)  # every token of a rank was routed
    assert sum(c[2] + c[3] for c in counts) > 0  # rank 1's experts (global 2, 3) were really used


def test_moe_settings_without_moe_layers_warn():
    with pytest.warns(UserWarning, match=r"enables moe \(ep_size=1\), but the model has no DeepSpeed MoE layers"):
        init_inference(tiny_gpt2(), dtype=torch.float, moe={"enabled": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        init_inference(tiny_gpt2(), dtype=torch.float)  # moe left at its defaults: nothing to say
        init_inference(MoENet(ep_size=1), dtype=torch.float, moe={"ep_size": 1, "moe_experts": [EXPERTS]})


@pytest.mark.filterwarnings("ignore:config key 'ep_size' is deprecated")
@pytest.mark.parametrize("build,config,message", [
    (1, {"moe": {"ep_size": 2}}, r"moe.ep_size=2, but the model's MoE layer 'moe' was built with ep_size=1"),
    (1, {"ep_size": 2}, r"moe.ep_size=2, but .* ep_size=1"),  # the deprecated top-level key too
    (1, {"moe": {"moe_experts": [8]}}, r"moe.moe_experts=\[8\], but .* has num_experts=4"),
    (1, {"moe": {"type": "residual"}}, r"moe.type='residual', but .* is a standard MoE"),
    (2, {"moe": {"enabled": False}}, r"moe.enabled=False, but .* is expert-parallel \(ep_size=2\)"),
    (2, {}, r"ep_size=2, which needs torch.distributed initialised"),
])
def test_bad_moe_combinations_are_clear_errors(build, config, message):
    with pytest.raises(ValueError, match=message):
        init_inference(MoENet(ep_size=build), dtype=torch.float, **config)


def test_residual_moe_type_is_accepted():
    model = MoENet(ep_size=1, residual=True)
    x = torch.randn(5, DIM)
    want = model(x)
    engine = init_inference(model, dtype=torch.float, moe={"type": "residual"})
    torch.testing.assert_close(engine(x), want)
