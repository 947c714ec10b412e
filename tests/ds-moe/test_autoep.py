"""AutoEP on tiny random Hugging Face MoE models: the converted model equals the original on the same weights.

Forward logits (and the router logits / aux loss Transformers records) match; one SGD step on the same data
matches, with gradients reduced as the engine reduces them (expert parameters summed over their
expert-data-parallel group and divided by the data-parallel world size, the rest averaged over data parallel).
autoep_size 1 runs in this process, autoep_size 2 on 2 gloo ranks (each rank its own batch, the reference
being one process holding every expert and averaging the two batches' losses). Then every documented error.
"""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from torch import nn

from ds_config import ConfigError, ExpertParallelConfig, load_config
from ds_moe import groups
from ds_moe.autoep import AutoEPMoELayer, apply_autoep, remap_parameters
from ds_moe.ep_experts import GroupedExperts
from ds_moe.utils import is_moe_param

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64,
              output_router_logits=True, router_aux_loss_coef=0.1)
LR = 0.5


def _config(family: str):
    if family == "mixtral":
        return transformers.MixtralConfig(**COMMON, num_key_value_heads=1, intermediate_size=24, num_local_experts=4,
                                          num_experts_per_tok=2)
    if family == "qwen3_moe":  # layer 1 is dense (mlp_only_layers): AutoEP must leave it alone
        return transformers.Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=1,
                                           intermediate_size=24, moe_intermediate_size=12, num_experts=4,
                                           num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
    if family == "qwen2_moe":  # the qwen3_moe preset; a sigmoid-gated shared expert
        return transformers.Qwen2MoeConfig(**COMMON, num_key_value_heads=1, intermediate_size=24,
                                           moe_intermediate_size=8, shared_expert_intermediate_size=12,
                                           num_experts=4, num_experts_per_tok=2)
    if family == "qwen3_5_moe":  # the text backbone; a linear-attention (Gated DeltaNet) and a full-attention layer
        return transformers.Qwen3_5MoeTextConfig(**COMMON, num_key_value_heads=1, moe_intermediate_size=8,
                                                 shared_expert_intermediate_size=12, num_experts=4,
                                                 num_experts_per_tok=2,
                                                 layer_types=["linear_attention", "full_attention"])
    if family == "deepseek_v2":  # softmax top-k scaled by routed_scaling_factor, a shared expert
        return transformers.DeepseekV2Config(**COMMON, num_key_value_heads=2, intermediate_size=24,
                                             moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2,
                                             n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=8,
                                             q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                                             topk_method="greedy", routed_scaling_factor=1.5)
    if family == "deepseek_v3":  # sigmoid scores, group-limited top-k, a shared expert; layer 0 dense
        return transformers.DeepseekV3Config(**COMMON, num_key_value_heads=2, intermediate_size=24,
                                             moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2,
                                             n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8,
                                             q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                                             n_group=2, topk_group=1)
    raise ValueError(family)


FAMILIES = ["mixtral", "qwen3_moe", "qwen2_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3"]
PRESET = {family: family for family in FAMILIES} | {"qwen2_moe": "qwen3_moe"}
BOTH = ["model.layers.0.mlp", "model.layers.1.mlp"]
MOE_LAYERS = {family: BOTH for family in FAMILIES} | {"qwen3_moe": ["model.layers.0.mlp", "model.layers.2.mlp"],
                                                      "deepseek_v3": ["model.layers.1.mlp"]}


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    with torch.no_grad():
        for module in model.modules():  # a non-zero DeepSeek score-correction bias, to be kept as is
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.uniform_(-0.1, 0.1)
    return model


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(10 + rank))


def _ep(size: int = 1, preset: str | None = "mixtral", **kw) -> ExpertParallelConfig:
    return ExpertParallelConfig(enabled=True, autoep_size=size, preset_model=preset, **kw)


def _reduce_like_the_engine(model: nn.Module, dp_world: int) -> None:
    """Expert grads: sum over the expert-data-parallel group / dp size; the others: the data-parallel mean."""
    for param in model.parameters():
        if param.grad is None:
            continue
        group = groups._get_expert_data_parallel_group(param.group_name) if is_moe_param(param) else None
        dist.all_reduce(param.grad, group=group)
        param.grad /= dp_world


def _sgd(model: nn.Module) -> None:
    torch.optim.SGD(model.parameters(), lr=LR).step()


def _reference_step(model: nn.Module, ranks: int) -> list[torch.Tensor]:
    """One process, every expert: the logits of each rank's batch, then an SGD step on the mean of their losses."""
    outs = [model(_batch(r), labels=_batch(r)) for r in range(ranks)]
    (sum(o.loss for o in outs) / ranks).backward()
    _sgd(model)
    return [o.logits.detach() for o in outs]


def _assert_same_params(got: nn.Module, want: nn.Module, ep_size: int, ep_rank: int) -> None:
    """Every parameter equal; AutoEP's ``w1`` / ``w3`` / ``w2`` are this rank's rows of the HF fused
    ``gate_up_proj`` (gate half, up half) and ``down_proj``."""
    mine = dict(got.named_parameters())
    for name, param in want.named_parameters():
        expected = param.detach()
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj") and f"{prefix}.w1" in mine:
            local = expected.shape[0] // ep_size
            expected = expected[ep_rank * local:(ep_rank + 1) * local]
            if leaf == "down_proj":
                pairs = [(f"{prefix}.w2", expected)]
            else:
                ffn = expected.shape[1] // 2
                pairs = [(f"{prefix}.w1", expected[:, :ffn]), (f"{prefix}.w3", expected[:, ffn:])]
        elif name not in mine and name.endswith(".gate.weight"):  # the block's router is AutoEP's router.gate
            pairs = [(f"{name[:-len('.gate.weight')]}.router.gate.weight", expected)]
        elif name not in mine:  # DeepSpeed's names for the shared expert and its gate
            pairs = [(name.replace(".shared_expert.", ".shared_experts.").replace(".shared_expert_gate.",
                                                                                 ".shared_experts_gate."), expected)]
        else:
            pairs = [(name, expected)]
        for key, value in pairs:
            torch.testing.assert_close(mine[key].detach(), value, rtol=1e-5, atol=1e-6, msg=key)


# ------------------------------------------------------------------ autoep_size 1: one process


@pytest.mark.parametrize("family", FAMILIES)
def test_single_process_matches_hf_forward_and_sgd_step(family):
    reference = _model(family)
    model = copy.deepcopy(reference)
    assert apply_autoep(model, _ep(1, PRESET[family])) == MOE_LAYERS[family]
    batch = _batch(0)
    got, want = model(batch, labels=batch), reference(batch, labels=batch)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    if want.router_logits is not None:  # Transformers still records the router logits (aux loss in the loss)
        for g, w in zip(got.router_logits, want.router_logits, strict=True):
            torch.testing.assert_close(g, w)
    got.loss.backward()
    want.loss.backward()
    _sgd(model)
    _sgd(reference)
    _assert_same_params(model, reference, 1, 0)


def test_replaced_layers_mark_expert_params_for_expert_data_parallel():
    model = _model("qwen3_moe")
    names = apply_autoep(model, _ep(1, None))  # preset from model.config.model_type
    assert names == MOE_LAYERS["qwen3_moe"]
    assert type(model.get_submodule("model.layers.1.mlp")).__name__ == "Qwen3MoeMLP"  # dense layer untouched
    layer = model.get_submodule(names[0])
    assert isinstance(layer, AutoEPMoELayer) and isinstance(layer.experts, GroupedExperts)
    experts = [n for n, p in model.named_parameters() if is_moe_param(p)]
    assert experts == [f"{n}.experts.{w}" for n in names for w in ("w1", "w2", "w3")]
    assert {p.group_name for p in model.parameters() if is_moe_param(p)} == {"ep_size_1"}
    assert {p.ds_zero_placement_family for p in layer.experts.parameters()} == {"autoep_expert"}
    assert layer.router.gate.weight.allreduce is True
    assert layer.router.gate.weight.ds_zero_placement_family == "replicated"
    assert layer.gate is layer.router  # the block's router name still reaches the router
    assert apply_autoep(model, _ep(1, None)) == []  # already converted: nothing to do
    assert apply_autoep(_model("mixtral"), ExpertParallelConfig(enabled=False)) == []


def test_parameter_lists_taken_before_the_conversion_can_be_remapped():
    model = _model("mixtral")
    before = list(model.parameters())
    param_groups = [{"params": before[:3], "lr": 0.1}, {"params": before[3:]}]
    apply_autoep(model, _ep(1))
    now = [id(p) for p in model.parameters()]
    assert [id(p) for p in before] != now
    assert [id(p) for p in remap_parameters(before, model)] == now
    remapped = remap_parameters(param_groups, model)
    assert [id(p) for g in remapped for p in g["params"]] == now and remapped[0]["lr"] == 0.1


def test_mixtral_training_jitter_draws_like_hf():
    reference = _model("mixtral")
    for layer in reference.model.layers:
        layer.mlp.jitter_noise = 0.2
    model = copy.deepcopy(reference)
    apply_autoep(model, _ep(1))
    assert model.model.layers[0].mlp.jitter_noise == 0.2
    torch.manual_seed(5)
    want = reference(_batch(0)).logits
    torch.manual_seed(5)
    torch.testing.assert_close(model(_batch(0)).logits, want, rtol=1e-5, atol=1e-6)


def _swiglu_per_expert(experts: GroupedExperts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The textbook SwiGLU of each expert on its rows, one expert at a time."""
    outs = []
    for e, rows in enumerate(torch.split(x, counts)):
        gate = rows @ experts.w1[e].to(x.dtype).t()
        up = rows @ experts.w3[e].to(x.dtype).t()
        outs.append((torch.nn.functional.silu(gate) * up) @ experts.w2[e].to(x.dtype).t())
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_a_loop_of_per_expert_mlps(dtype):
    torch.manual_seed(0)
    counts = [6, 0, 7, 3]  # expert 1 gets no row
    grads = []
    for grouped in (True, False):
        torch.manual_seed(1)
        experts = GroupedExperts(8, 16, 4, use_grouped_mm=grouped).to(dtype)
        for w in experts.parameters():
            nn.init.normal_(w, std=0.3)
        x = torch.randn(sum(counts) + 2, 8, dtype=dtype)  # two trailing padding rows
        out = experts(x, torch.tensor(counts))
        assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))  # padding rows come back zero
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(out[:-2], _swiglu_per_expert(experts, x[:-2], counts), **tol)
        (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([w.grad.float() for w in (experts.w1, experts.w2, experts.w3)])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_received_rows_regroup_by_local_expert_with_aligned_padding():
    from ds_moe.ep_kernels import TOKEN_GROUP_ALIGN_SIZE_M as A
    from ds_moe.ep_kernels import permute_by_local_expert, unpermute_by_local_expert

    # from rank 0: 1 row for local expert 0, 2 for expert 1; from rank 1: 3 for expert 0, none for expert 1
    rows = torch.arange(6.0).view(6, 1).expand(6, 3).contiguous()
    grouped, indices, sizes, n = permute_by_local_expert(rows, torch.tensor([[1, 2], [3, 0]]))
    assert sizes.tolist() == [A, A] and n == 6
    assert grouped[:4, 0].tolist() == [0, 3, 4, 5] and grouped[A:A + 2, 0].tolist() == [1, 2]
    assert torch.equal(grouped[4:A], torch.zeros(A - 4, 3))  # padding is zero rows
    assert torch.equal(unpermute_by_local_expert(grouped, indices, n), rows)  # bitwise round trip


# ------------------------------------------------------------------ autoep_size 2: two gloo ranks


def _two_ranks(family: str, ep_size: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _model(family)
    model = copy.deepcopy(reference)
    assert apply_autoep(model, _ep(ep_size, PRESET[family])) == MOE_LAYERS[family]
    layer = model.get_submodule(MOE_LAYERS[family][0])
    assert layer.num_local_experts == layer.experts.num_experts == 4 // ep_size and layer.ep_rank == rank % ep_size
    name = f"ep_size_{ep_size}"
    assert len(groups._get_expert_data_parallel_group_ranks(name)) == world // ep_size
    want_logits = _reference_step(reference, world)[rank]
    out = model(_batch(rank), labels=_batch(rank))
    torch.testing.assert_close(out.logits, want_logits, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    _reduce_like_the_engine(model, world)
    _sgd(model)
    _assert_same_params(model, reference, ep_size, rank % ep_size)
    layer.set_deepspeed_parallelism()  # what the engine calls: the groups exist, the binding stays
    assert layer.ep_group is groups._get_expert_parallel_group(name)


@pytest.mark.parametrize(("family", "ep_size"), [("mixtral", 2), ("qwen3_moe", 2), ("deepseek_v3", 2), ("mixtral", 1)],
                         ids=["mixtral-ep2", "qwen3_moe-ep2", "deepseek_v3-ep2", "mixtral-ep1-edp2"])
def test_two_ranks_match_hf(family, ep_size):
    run_distributed(_two_ranks, world_size=2, args=(family, ep_size), timeout=90)


# ------------------------------------------------------------------ errors


def test_autoep_size_must_divide_num_experts():
    with pytest.raises(ValueError, match=r"num_experts=4 in layer 'model.layers.0.mlp' is not divisible by "
                                         r"expert_parallel.autoep_size=3; valid values: \[1, 2, 4\]"):
        apply_autoep(_model("mixtral"), _ep(3), world_size=3)


def test_autoep_size_must_divide_the_world_size():
    with pytest.raises(ValueError, match=r"expert_parallel.autoep_size \* expert_parallel.expert_tensor_parallel_"
                                         r"size \(2 \* 1 = 2\) must divide the stage size \(world_size=3"):
        apply_autoep(_model("mixtral"), _ep(2), world_size=3)


def test_autoep_size_above_one_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="expert_parallel.autoep_size=2 needs torch.distributed"):
        apply_autoep(_model("mixtral"), _ep(2), world_size=2)


@pytest.mark.parametrize(("section", "path"), [
    ({"expert_parallel": {"enabled": True, "preset_model": "deepseek_v3", "load_balance_coeff": 0.01}},
     "expert_parallel.load_balance_coeff"),
])
def test_config_rejects_load_balance_coeff(section, path):  # AutoTP folds (tests/ds-moe/test_autoep_folding*.py)
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 2, "expert_parallel": {"enabled": True, "preset_model": "mixtral"}, **section})
    assert err.value.paths == [path]


@pytest.mark.parametrize("value", [0.01, 0, False, "1e-3"])
def test_load_balance_coeff_rejected_even_past_validation(value):
    config = ExpertParallelConfig.model_construct(enabled=True, autoep_size=1, preset_model="deepseek_v3",
                                                  load_balance_coeff=value)
    with pytest.raises(ValueError) as err:
        apply_autoep(_model("deepseek_v3"), config)
    for words in ("expert_parallel.load_balance_coeff", repr(value), "not supported", "null", "omit"):
        assert words in str(err.value)


def test_tensor_parallel_mpu_is_rejected(monkeypatch):
    monkeypatch.setattr(groups, "mpu", types.SimpleNamespace(get_tensor_model_parallel_world_size=lambda: 2))
    with pytest.raises(ValueError, match=r"expert_parallel.enabled: .*bwc_tensor_model_parallel_world_size=2"):
        apply_autoep(_model("mixtral"), _ep(1))


def test_transformers_too_old_names_preset_and_version(monkeypatch):
    model = _model("deepseek_v3")
    # Transformers re-registers its lazy top-level module while building models: patch the live one
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.51.3")
    with pytest.raises(ValueError) as err:
        apply_autoep(model, _ep(1, "deepseek_v3"))
    message = str(err.value)
    assert "'deepseek_v3'" in message and "transformers==4.51.3" in message and ">= 5.0.0" in message


class _LegacyBlock(nn.Module):  # Transformers 4.x Mixtral layout: a Linear gate, a ModuleList of experts
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 4, bias=False)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))


def _legacy_model() -> nn.Module:
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(nn.Module() for _ in range(2))
    for layer in model.model.layers:
        layer.mlp = _LegacyBlock()
    return model


def test_legacy_module_list_layout_is_rejected():
    model = _legacy_model()
    model.config = types.SimpleNamespace(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"preset 'mixtral' matched layer 'model.layers.0.mlp'.*cannot infer"):
        apply_autoep(model, _ep(1))


def test_unsupported_model_type_names_the_supported_variant():
    model = _legacy_model()
    model.config = types.SimpleNamespace(model_type="qwen3_5_moe")
    with pytest.raises(ValueError, match=r"does not support model_type='qwen3_5_moe'.*qwen3_5_moe_text"):
        apply_autoep(model, _ep(1, None))


def test_no_matching_block_is_an_error_for_a_chosen_preset():
    with pytest.raises(ValueError, match=r"no MoE layers detected for preset_model='deepseek_v2'"):
        apply_autoep(nn.Sequential(nn.Linear(2, 2)), _ep(1, "deepseek_v2"))
