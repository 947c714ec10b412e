"""MoE through the engine on gloo ranks: a model with a 4-expert ``deepspeed.moe.layer.MoE`` trains to the same
losses and weights with ``ep_size=2`` (2 ranks; 2 ranks x 2 data-parallel replicas) as with ``ep_size=1`` (every rank
holding every expert), fp32 with clipping; checkpoints in DeepSpeed's MoE layout load back exactly and onto another
``ep_size``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from torch import nn

DIM, EXPERTS, STEPS, GAS = 8, 4, 3, 2


class Net(nn.Module):
    def __init__(self, ep_size: int, k: int = 1) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        torch.manual_seed(0)
        self.inp = nn.Linear(DIM, DIM)
        expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.moe = MoE(DIM, expert, num_experts=EXPERTS, ep_size=ep_size, k=k, drop_tokens=False, min_capacity=0)
        self.out = nn.Linear(DIM, 1)
        self.ep_rank = dist.get_rank() % ep_size
        self.reset_experts()

    def reset_experts(self) -> None:
        """Global expert g gets the weights of seed 100 + g, whichever rank holds it."""
        local = self.moe.num_local_experts
        with torch.no_grad():
            for i, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                torch.manual_seed(100 + self.ep_rank * local + i)
                for p in expert.parameters():
                    p.copy_(torch.randn_like(p) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(h).squeeze(-1), l_aux


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(6, DIM, generator=g), torch.randn(6, generator=g)) for _ in range(n)]


def _config(stage: int = 0, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "gradient_clipping": 0.3,
            "zero_optimization": {"stage": stage}, **extra}


def _step(engine, batches) -> float:
    total = 0.0
    dtype = next(engine.module.parameters()).dtype
    for x, y in batches:
        pred, l_aux = engine(x.to(dtype))
        loss = nn.functional.mse_loss(pred.float(), y) + 0.01 * l_aux.float()
        engine.backward(loss)
        engine.step()
        total += float(loss) / GAS
    return total


def _experts_by_global_id(engine) -> dict[int, torch.Tensor]:
    net = engine.module
    local = net.moe.num_local_experts
    return {net.ep_rank * local + i: torch.cat([p.detach().flatten() for p in e.parameters()])
            for i, e in enumerate(net.moe.deepspeed_moe.experts.deepspeed_experts)}


def _train(ep_size: int, stage: int = 0, **extra) -> dict:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=Net(ep_size), config=_config(stage, **extra))
    data = _batches(dist.get_rank(), STEPS * GAS)
    losses = [_step(engine, data[s * GAS:(s + 1) * GAS]) for s in range(STEPS)]
    return {"losses": losses, "experts": _experts_by_global_id(engine),
            "shared": engine.module.inp.weight.detach().clone(), "norm": engine.get_global_grad_norm()}


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_every_rank_holding_every_expert(world):
    dense = run_distributed(_train, world_size=world, args=(1,), timeout=120)
    sharded = run_distributed(_train, world_size=world, args=(2,), timeout=120)
    for d, s in zip(dense, sharded, strict=True):
        torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(d["losses"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(s["shared"], d["shared"], rtol=1e-5, atol=1e-7)
        assert s["norm"] == pytest.approx(d["norm"], rel=1e-5)
        for g, weights in s["experts"].items():
            torch.testing.assert_close(weights, d["experts"][g], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_expert_parallel_in_half_precision(precision):
    extra = {precision: {"enabled": True}} if precision == "bf16" else {precision: {"enabled": True,
                                                                                 "initial_scale_power": 8}}
    dense = run_distributed(_train, world_size=2, args=(1,), kwargs=extra, timeout=120)
    sharded = run_distributed(_train, world_size=2, args=(2,), kwargs=extra, timeout=120)
    for d, s in zip(dense, sharded, strict=True):
        assert all(torch.isfinite(torch.tensor(s["losses"])))
        torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(d["losses"]), rtol=2e-2, atol=1e-3)


def _save_and_resume(ep_save: int, ep_load: int, save_dir: str) -> dict:
    import deepspeed

    data = _batches(dist.get_rank(), 4 * GAS)
    engine, *_ = deepspeed.initialize(model=Net(ep_save), config=_config())
    for s in range(2):
        _step(engine, data[s * GAS:(s + 1) * GAS])
    engine.save_checkpoint(save_dir, tag="t")
    expected = [_step(engine, data[s * GAS:(s + 1) * GAS]) for s in (2, 3)]
    files = sorted(os.listdir(os.path.join(save_dir, "t")))
    fresh, *_ = deepspeed.initialize(model=Net(ep_load), config=_config())
    fresh.load_checkpoint(save_dir, tag="t", load_optimizer_states=ep_load == ep_save)
    experts = _experts_by_global_id(fresh)
    got = [_step(fresh, data[s * GAS:(s + 1) * GAS]) for s in (2, 3)]
    return {"expected": expected, "got": got, "files": files, "experts_after_load": experts}


def test_moe_checkpoint_layout_and_exact_resume(tmp_path):
    got = run_distributed(_save_and_resume, world_size=2, args=(2, 2, str(tmp_path)), timeout=120)
    assert got[0]["files"] == ["expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt",
                               *(f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(EXPERTS)),
                               "mp_rank_00_model_states.pt"]
    state = torch.load(tmp_path / "t" / "mp_rank_00_model_states.pt", weights_only=False)
    assert not [k for k in state["module"] if "deepspeed_experts" in k] and state["num_experts"] == [EXPERTS]
    for r in got:
        torch.testing.assert_close(torch.tensor(r["got"]), torch.tensor(r["expected"]), rtol=1e-6, atol=0)


def test_moe_checkpoint_loads_onto_another_ep_size(tmp_path):
    saved = run_distributed(_save_and_resume, world_size=2, args=(2, 1, str(tmp_path)), timeout=120)
    # every rank now holds all 4 experts, each the saved global expert
    expert_file = torch.load(tmp_path / "t" / "layer_0_expert_3_mp_rank_00_model_states.pt", weights_only=True)
    saved_weight = next(v for k, v in expert_file.items() if k.endswith("deepspeed_experts.3.0.weight"))
    for r in saved:
        assert sorted(r["experts_after_load"]) == [0, 1, 2, 3]
        torch.testing.assert_close(r["experts_after_load"][3][:saved_weight.numel()], saved_weight.flatten())


def _load_with_missing_expert(save_dir: str) -> str:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=Net(2), config=_config())
    try:
        engine.load_checkpoint(save_dir, tag="t")
    except (FileNotFoundError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_missing_expert_file_is_named(tmp_path):
    run_distributed(_save_and_resume, world_size=2, args=(2, 2, str(tmp_path)), timeout=120)
    (tmp_path / "t" / "layer_0_expert_2_mp_rank_00_model_states.pt").unlink()
    got = run_distributed(_load_with_missing_expert, world_size=2, args=(str(tmp_path),), timeout=120)
    # rank 1 (experts 2, 3) misses the file; rank 0, which read its own experts, fails with the same message
    for message in got:
        assert message.startswith("CheckpointRankError") and "failed on ranks [1] while reading" in message
        assert "layer_0_expert_2_mp_rank_00_model_states.pt: missing" in message
