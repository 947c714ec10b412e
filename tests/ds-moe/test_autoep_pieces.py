"""AutoEP's pieces under DeepSpeed's names: repacking (bitwise, every source layout, ZeRO-3 sources gathered on 2
ranks), the top-k router's options, the split plan's one count exchange on 3 gloo ranks, configuration parsing
and validation, preset choice and custom patterns."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from torch import nn

from ds_moe.autoep import AutoEP, AutoEPConfig, AutoEPMoELayer, parse_autoep_config, validate_autoep_config
from ds_moe.autoep.config import fill_autoep_config_from_hf, validate_autoep_post_detection
from ds_moe.autoep.detect import _resolve_route_scale
from ds_moe.autoep.layer import compute_split_plan
from ds_moe.autoep.presets import PRESET_MODELS, preset_name_for_hf_model_type
from ds_moe.ep_repack import repack_expert_weights
from ds_moe.ep_router import TokenChoiceTopKRouter

E, H, F = 4, 8, 6


class _Experts(nn.Module):
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up)
        self.down_proj = nn.Parameter(down)


class _Block(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = experts


def _model(experts: nn.Module, model_type: str = "mixtral") -> nn.Module:
    model = nn.Module()
    model.config = types.SimpleNamespace(model_type=model_type, num_local_experts=E, num_experts_per_tok=2)
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Module()])
    model.model.layers[0].mlp = _Block(experts)
    return model


def _spec(model: nn.Module, **config):
    return AutoEP(model, AutoEPConfig(enabled=True, use_grouped_mm=False, **config)).ep_parser()[0]


@pytest.mark.parametrize("layout", ["gate_up_first", "hidden_first"])
def test_fused_repack_round_trips_bitwise(layout):
    torch.manual_seed(0)
    gate_up, down = torch.randn(E, 2 * F, H), torch.randn(E, H, F)
    if layout == "hidden_first":  # Transformers' transposed layout: x @ w
        source = _Experts(gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous())
    else:
        source = _Experts(gate_up.clone(), down.clone())
    model = _model(source)
    spec = _spec(model)
    assert (spec.expert_storage, spec.hidden_size, spec.ffn_hidden_size) == ("fused_3d", H, F)
    parts = [repack_expert_weights(source, spec, rank, 2) for rank in range(2)]
    w1, w2, w3 = (torch.cat([p[i] for p in parts]) for i in range(3))
    assert w1.shape == (E, F, H) and w2.shape == (E, H, F) and w3.shape == (E, F, H)
    assert torch.equal(torch.cat([w1, w3], dim=1), gate_up) and torch.equal(w2, down)  # nothing rounded


def test_module_list_repack_round_trips_bitwise_and_fused_w3_by_name():
    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(H, F, bias=False), nn.Linear(H, F, bias=False)
            self.down_proj = nn.Linear(F, H, bias=False)

    experts = nn.ModuleList(Mlp() for _ in range(E))
    model = _model(experts, "deepseek_v3")
    model.config = types.SimpleNamespace(model_type="deepseek_v3", n_routed_experts=E, num_experts_per_tok=2)
    spec = _spec(model)
    assert (spec.expert_storage, spec.expert_w1_name, spec.expert_w3_name) == ("module_list", "gate_proj", "up_proj")
    w1, w2, w3 = repack_expert_weights(experts, spec, 1, 2)
    for i, e in enumerate((2, 3)):
        assert torch.equal(w1[i], experts[e].gate_proj.weight) and torch.equal(w3[i], experts[e].up_proj.weight)
        assert torch.equal(w2[i], experts[e].down_proj.weight)


def _zero3_repack() -> None:
    from ds_zero.zero3 import Init

    torch.manual_seed(3)
    reference = _model(_Experts(torch.randn(E, 2 * F, H), torch.randn(E, H, F)))
    torch.manual_seed(3)
    with Init():
        model = _model(_Experts(torch.randn(E, 2 * F, H), torch.randn(E, H, F)))
    source = model.model.layers[0].mlp
    assert source.experts.gate_up_proj.numel() == 0  # partitioned: nothing whole on this rank
    auto_ep = AutoEP(model, AutoEPConfig(enabled=True, autoep_size=2, use_grouped_mm=False))
    spec = auto_ep.ep_parser()[0]  # sizes from ds_shape
    assert (spec.num_experts, spec.hidden_size, spec.ffn_hidden_size) == (E, H, F)
    rank = dist.get_rank()
    auto_ep.replace_moe_layer(spec, ep_size=2, ep_rank=rank)
    layer = model.model.layers[0].mlp
    assert isinstance(layer, AutoEPMoELayer)
    full = reference.model.layers[0].mlp.experts.gate_up_proj.detach()[2 * rank:2 * rank + 2]
    assert torch.equal(torch.cat([layer.experts.w1, layer.experts.w3], dim=1), full)
    assert torch.equal(layer.router.gate.weight, reference.model.layers[0].mlp.gate.weight)
    assert source.experts.gate_up_proj.numel() == 0  # released again after the read


def test_zero3_partitioned_sources_are_gathered_for_repacking():
    run_distributed(_zero3_repack, world_size=2, timeout=90)


def test_router_scale_groups_and_correction_bias():
    torch.manual_seed(0)
    base = TokenChoiceTopKRouter(H, 8, None, None, 2, "sigmoid", True, 1.0, False)
    x = torch.randn(30, H)
    scores, experts, counts = base(x)
    assert torch.allclose(scores.sum(-1), torch.ones(30)) and counts.dtype == torch.int32
    assert torch.equal(counts, torch.bincount(experts.reshape(-1), minlength=8).int())
    grouped = TokenChoiceTopKRouter(H, 8, 4, 1, 2, "sigmoid", False, 2.5, False)
    grouped.load_state_dict(base.state_dict())
    g_scores, g_experts, _ = grouped(x)
    assert torch.equal(g_experts // 2, g_experts[:, :1].expand(-1, 2) // 2)  # both picks in one group of 2
    probs = torch.sigmoid(base.gate(x))
    torch.testing.assert_close(g_scores, probs.gather(1, g_experts) * 2.5)  # scaled, not renormalised
    biased = TokenChoiceTopKRouter(H, 8, None, None, 1, "sigmoid", False, 1.0, False)
    biased.load_state_dict(base.state_dict())
    biased.e_score_correction_bias = torch.tensor([0, 0, 0, 0, 0, 0, 0, 10.0])  # steers the choice only
    b_scores, b_experts, _ = biased(x)
    assert (b_experts == 7).all() and torch.allclose(b_scores[:, 0], probs[:, 7])


def _split_plans(all_counts: list[list[int]]) -> tuple:
    rank = dist.get_rank()
    mine = torch.tensor(all_counts[rank])
    selected = torch.repeat_interleave(torch.arange(6), mine)
    plan = compute_split_plan(selected, 6, 3, 2, None)
    return plan.input_splits, plan.output_splits, plan.local_counts.tolist(), plan.local_counts_by_source.tolist()


def test_split_plan_exchanges_counts_once_on_three_ranks():
    counts = [[11, 0, 0, 0, 0, 1], [0, 1, 0, 9, 0, 0], [0, 0, 4, 0, 0, 8]]
    results = run_distributed(_split_plans, world_size=3, args=(counts,), timeout=60)
    for rank, (sent, received, local, by_source) in enumerate(results):
        rows = torch.tensor(counts).view(3, 3, 2)  # [source, destination, local expert]
        assert sent == rows[rank].sum(-1).tolist()
        assert by_source == rows[:, rank].tolist() and received == rows[:, rank].sum(-1).tolist()
        assert local == rows[:, rank].sum(0).tolist()


def test_config_parse_keeps_absent_apart_from_null_and_validates_keys():
    assert parse_autoep_config({}).enabled is False
    config = parse_autoep_config({"enabled": True, "expert_w3": None, "load_balance_coeff": None})
    assert config.expert_w3 is None and config._load_balance_coeff_explicit is True
    assert parse_autoep_config({"enabled": True})._load_balance_coeff_explicit is False
    for bad, words in ((dict(score_apply="later"), "expert_parallel.score_apply"),
                       (dict(expert_w1="a.b"), "expert_parallel.expert_w1"),
                       (dict(num_expert_groups=2, num_limited_groups=3), "num_limited_groups (3) must be <="),
                       (dict(preset_model="llama"), "unknown preset 'llama'"),
                       (dict(autoep_size=3), "must divide the stage size")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            validate_autoep_config(AutoEPConfig(enabled=True, **bad), world_size=4, pp_size=1, tp_size=1, sp_size=1)
    model = _model(_Experts(torch.randn(E, 2 * F, H), torch.randn(E, H, F)))
    spec = _spec(model)
    with pytest.raises(ValueError, match=r"autoep_size=8 exceeds num_experts=4 .*\[1, 2, 4\]"):
        validate_autoep_post_detection(AutoEPConfig(enabled=True, autoep_size=8), [spec])


def test_deepseek_defaults_come_from_model_config_unless_set():
    hf = types.SimpleNamespace(n_group=4, topk_group=2, routed_scaling_factor=2.5)
    config = AutoEPConfig(enabled=True)
    fill_autoep_config_from_hf(config, hf)
    assert (config.num_expert_groups, config.num_limited_groups, config.route_scale) == (4, 2, 2.5)
    assert _resolve_route_scale(AutoEPConfig(routed_scaling_factor=3), hf) == 3.0
    for bad in (True, float("nan"), "2"):
        with pytest.raises(ValueError, match="routed_scaling_factor must be a finite number"):
            _resolve_route_scale(AutoEPConfig(routed_scaling_factor=bad), None)


def test_presets_and_custom_patterns():
    assert set(PRESET_MODELS) == {"mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3"}
    assert preset_name_for_hf_model_type("qwen2_moe") == "qwen3_moe"
    model = nn.Module()  # a model no preset knows: blocks found by the config's own patterns
    model.blocks = nn.ModuleList([nn.Module(), nn.Module()])
    for block in model.blocks:
        block.ffn = nn.Module()
        block.ffn.router = nn.Linear(H, E, bias=True)
        block.ffn.moe = _Experts(torch.randn(E, 2 * F, H), torch.randn(E, H, F))
    auto_ep = AutoEP(model, AutoEPConfig(enabled=True, moe_layer_pattern=r"blocks\.\d+\.ffn", router_pattern="router",
                                         expert_pattern="moe", top_k=2, use_grouped_mm=False))
    specs = auto_ep.ep_parser()
    assert [s.moe_module_name for s in specs] == ["blocks.0.ffn", "blocks.1.ffn"]
    assert specs[0].model_family == "custom" and specs[0].gate_bias is True
    bias = model.blocks[0].ffn.router.bias.detach().clone()
    auto_ep.replace_moe_layers(specs, 1, 0)
    assert model.blocks[1].ffn(torch.randn(2, 3, H)).shape == (2, 3, H)
    assert torch.equal(model.blocks[0].ffn.router.gate.bias, bias)  # the gate's bias is kept
