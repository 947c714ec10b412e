"""AutoEP with ZeRO stage 3: expert parameters are partitioned over their expert-data-parallel group (the ranks
holding the same experts), the rest over the data-parallel group. On 4 gloo ranks with ``autoep_size`` 2, losses,
expert gradients, gradient norms and the trained weights equal ZeRO stage 2's AutoEP run on the same seeds and
batches; a checkpoint saved at stage 3 resumes to the same next loss, also through a Universal Checkpoint loaded at
``autoep_size`` 2 and 1; consolidating it (zero_to_fp32, the 16-bit export) is refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from torch import nn

STEPS = 3


class _Experts(nn.Module):  # a Mixtral-style fused expert block: [E, 2F, H] and [E, H, F]
    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * ffn, hidden) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, ffn) * 0.1)


class _MoEBlock(nn.Module):
    def __init__(self, experts: int = 4, hidden: int = 16, ffn: int = 24) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = _Experts(experts, hidden, ffn)
        self.top_k = 2


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = type("Cfg", (), {"model_type": "mixtral", "num_local_experts": 4, "hidden_size": 16,
                                       "intermediate_size": 24, "num_experts_per_tok": 2})()
        self.inp = nn.Linear(16, 16)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        self.model.layers[0].mlp = _MoEBlock()
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + self.model.layers[0].mlp(h))


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
            "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
            "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral",
                                "use_grouped_mm": False}}


def _full_expert_grads(engine: object) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for name, p in engine.module.named_parameters():
        if ".experts." in name:
            out[name] = safe_get_full_grad(p).detach().float().clone()
    return out


def _train(stage: int, save_dir: str | None = None, zero_init: bool = False) -> dict:
    import deepspeed

    torch.manual_seed(0)
    if zero_init:  # the MoE block's weights arrive partitioned over every rank; AutoEP gathers them
        with deepspeed.zero.Init(config_dict_or_path=_config(stage)):
            model = _Model()
    else:
        model = _Model()
    engine, *_ = deepspeed.initialize(model=model, config=_config(stage))
    # the two expert-parallel ranks of one data-parallel replica see the same tokens: batch by data-parallel rank
    replica = dist.get_rank() // 2
    losses, grads, norms = [], [], []
    for step in range(STEPS):
        for micro in range(2):
            x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(100 * step + 10 * micro + replica))
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            losses.append(float(loss))
            if micro == 1:
                grads.append(_full_expert_grads(engine))
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    out = {"losses": losses, "grads": grads, "norms": norms,
           "placement": sorted({(n.rsplit(".", 1)[-1], p.ds_zero_partition_world_size)
                                for n, p in engine.module.named_parameters()}) if stage == 3 else None}
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="z3")
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(999 + replica))
        out["next"] = float(engine(x).pow(2).mean())
        torch.manual_seed(1)  # other initial weights: the load must bring the trained ones back
        again, *_ = deepspeed.initialize(model=_Model(), config=_config(stage))
        again.load_checkpoint(save_dir, tag="z3")
        out["resumed"] = float(again(x).pow(2).mean())
        out["universal"] = _universal_resume(save_dir, x)
    return out


def _universal_resume(save_dir: str, x: torch.Tensor) -> dict[int, float]:
    """Convert the ZeRO-3 AutoEP checkpoint to a Universal Checkpoint, load it at autoep_size 2 and 1 (each rank's
    expert rows cut from every expert's file): the next loss, per autoep_size."""
    import deepspeed
    from deepspeed.checkpoint.ds_to_universal import convert

    if dist.get_rank() == 0:
        convert(f"{save_dir}/z3", f"{save_dir}/z3_universal")
    dist.barrier()
    out = {}
    for ep in (2, 1):
        cfg = _config(3)
        cfg["expert_parallel"]["autoep_size"] = ep
        cfg["checkpoint"] = {"load_universal": True}
        torch.manual_seed(2)
        engine, *_ = deepspeed.initialize(model=_Model(), config=cfg)
        engine.load_checkpoint(save_dir, tag="z3_universal")
        out[ep] = float(engine(x).pow(2).mean())
    return out


def test_zero3_autoep_from_a_zero_init_model_trains_the_same():
    whole = run_distributed(_train, world_size=4, args=(3,), timeout=240)
    built = run_distributed(_train, world_size=4, args=(3, None, True), timeout=240)
    for want, got in zip(whole, built, strict=True):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=1e-7)
        assert got["placement"] == want["placement"]


def test_zero3_autoep_checkpoint_refuses_consolidation(tmp_path):
    """zero_to_fp32 and the 16-bit export would put one expert-parallel rank's experts in place of all of them."""
    def body(save_dir: str) -> str:
        import deepspeed
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        torch.manual_seed(0)
        engine, *_ = deepspeed.initialize(model=_Model(), config=_config(3))
        engine.save_checkpoint(save_dir, tag="z3")
        with pytest.raises(NotImplementedError, match="ds_to_universal.py"):
            engine._zero3_consolidated_16bit_state_dict()
        dist.barrier()
        if dist.get_rank() == 0:
            with pytest.raises(NotImplementedError, match="ds_to_universal.py"):
                get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="z3")
        return "ok"

    assert run_distributed(body, world_size=4, args=(str(tmp_path),), timeout=120) == ["ok"] * 4


def test_zero3_autoep_matches_zero2_autoep(tmp_path):
    two = run_distributed(_train, world_size=4, args=(2,), timeout=240)
    three = run_distributed(_train, world_size=4, args=(3, str(tmp_path)), timeout=240)
    for rank, (want, got) in enumerate(zip(two, three, strict=True)):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=1e-6,
                                   msg=f"rank {rank} losses")
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=1e-5, atol=1e-6)
        for step, (g_want, g_got) in enumerate(zip(want["grads"], got["grads"], strict=True)):
            assert sorted(g_got) == sorted(g_want)
            for name in g_want:
                torch.testing.assert_close(g_got[name], g_want[name], rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank} step {step} {name}")
        # experts over the expert-data-parallel group (2 ranks), everything else over all 4
        assert dict(got["placement"]) == {"w1": 2, "w2": 2, "w3": 2, "weight": 4, "bias": 4}
        assert got["resumed"] == pytest.approx(got["next"], rel=1e-6)
        assert got["universal"][2] == pytest.approx(got["next"], rel=1e-6)
        assert got["universal"][1] == pytest.approx(got["next"], rel=1e-5)
