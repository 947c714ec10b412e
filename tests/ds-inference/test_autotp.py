"""AutoTP sharding (ds_inference.autotp): tiny random GPT-2 / Llama / BERT sharded over 2 gloo ranks give the
unsharded model's outputs and gradients; tp_plan, full/sharded weight round trips, injection_policy, errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _autotp_models import ids, output, tiny
from _harness import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_inference.autotp import (
    AutoTPConfig,
    PartitionType,
    ShardMeta,
    TPLayerSpec,
    hf_tp_plan_specs,
    make_layout,
    shard_sizes,
)

EXPECTED_PLAN = {
    "gpt2": {"transformer.wte.weight": 1, "lm_head.weight": 1, "transformer.wpe.weight": None,
             "transformer.h.0.attn.c_attn.weight": 1, "transformer.h.0.attn.c_attn.bias": 0,
             "transformer.h.0.attn.c_proj.weight": 0, "transformer.h.0.attn.c_proj.bias": None,
             "transformer.h.1.mlp.c_fc.weight": 1, "transformer.h.1.mlp.c_proj.weight": 0,
             "transformer.h.0.ln_1.weight": None},
    "llama": {"model.embed_tokens.weight": 1, "lm_head.weight": 1, "model.layers.0.self_attn.q_proj.weight": 0,
              "model.layers.0.self_attn.k_proj.weight": 0, "model.layers.0.self_attn.o_proj.weight": 1,
              "model.layers.1.mlp.gate_proj.weight": 0, "model.layers.1.mlp.down_proj.weight": 1,
              "model.norm.weight": None, "model.layers.0.input_layernorm.weight": None},
    "bert": {"embeddings.word_embeddings.weight": 1, "embeddings.position_embeddings.weight": None,
             "encoder.layer.0.attention.self.query.weight": 0, "encoder.layer.0.attention.self.query.bias": 0,
             "encoder.layer.0.attention.output.dense.weight": 1, "encoder.layer.0.attention.output.dense.bias": None,
             "encoder.layer.1.intermediate.dense.weight": 0, "encoder.layer.1.output.dense.weight": 1,
             "pooler.dense.weight": None},
}


def _sharded_equals_unsharded(kind: str, policy: bool) -> dict:
    from ds_inference.autotp import autotp_shard, full_state_dict, load_full_state_dict, tp_plan

    ref, model, tokens = tiny(kind), tiny(kind), ids()
    injection = None
    if policy:  # BERT's all-reduce linears named by hand, as DeepSpeed's BERT example does
        from transformers.models.bert.modeling_bert import BertLayer

        injection = {BertLayer: ("attention.output.dense", "output.dense")}
    autotp_shard(model, None, injection_policy=injection)
    torch.testing.assert_close(output(model, tokens), output(ref, tokens), rtol=0, atol=1e-5)
    if kind != "bert":  # greedy generation with the KV cache (local heads) gives the same tokens
        prompt = ids(1, 5)
        assert torch.equal(model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0),
                           ref.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0))
    # gradients: the sharded model's, gathered back to full tensors, equal the unsharded model's
    output(ref, tokens).pow(2).mean().backward()
    output(model, tokens).pow(2).mean().backward()
    for name, layer in _tp_layers(model).items():
        for pname, dim in layer.partition_dims().items():
            grad = getattr(layer, pname).grad
            full = grad if dim is None else layer._tp_layouts[pname].gather(grad, dim, None)
            torch.testing.assert_close(full, ref.get_parameter(f"{name}.{pname}").grad, rtol=0, atol=1e-5)
    plan = tp_plan(model)
    assert set(plan) == set(dict(ref.named_parameters(remove_duplicate=False)))
    full = full_state_dict(model)
    assert all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    with torch.no_grad():  # load new full weights into the shards: outputs follow
        for p in ref.parameters():
            p.mul_(0.5)
    load_full_state_dict(model, ref.state_dict())
    torch.testing.assert_close(output(model, tokens), output(ref, tokens), rtol=0, atol=1e-5)
    local = model.state_dict()
    return {"plan": {k: plan[k] for k in EXPECTED_PLAN[kind]},
            "shapes": {k: tuple(local[k].shape) for k in EXPECTED_PLAN[kind] if plan[k] is not None}}


def _tp_layers(model):
    from ds_inference.autotp import tp_layers

    return tp_layers(model)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_two_ranks_equal_the_unsharded_model(kind):
    results = run_distributed(_sharded_equals_unsharded, world_size=2, args=(kind, False), timeout=120)
    assert results[0]["plan"] == EXPECTED_PLAN[kind]
    assert results[0]["shapes"] == results[1]["shapes"] or kind == "bert"  # even splits at this size
    for name, shape in results[0]["shapes"].items():
        dim = EXPECTED_PLAN[kind][name]
        full = dict(tiny(kind).state_dict())[name].shape[dim]
        assert shape[dim] + results[1]["shapes"][name][dim] == full  # the two shards tile the dimension


def test_injection_policy_names_the_allreduce_linears():
    results = run_distributed(_sharded_equals_unsharded, world_size=2, args=("bert", True), timeout=120)
    assert results[0]["plan"] == EXPECTED_PLAN["bert"]


def _head_counts_and_errors() -> dict:
    from ds_inference.autotp import autotp_shard

    gpt2, llama, bert = tiny("gpt2"), tiny("llama"), tiny("bert")
    for model in (gpt2, llama, bert):
        autotp_shard(model, None)
    attn = gpt2.transformer.h[0].attn
    self_attn = bert.encoder.layer[0].attention.self
    with pytest.raises(ValueError, match="no linear layers"):
        autotp_shard(torch.nn.Sequential(torch.nn.ReLU()), None)
    with pytest.raises(ValueError, match="tp_grain_size"):
        autotp_shard(tiny("gpt2"), None, tp_grain_size=0)
    with pytest.raises(TypeError, match="injection_policy"):
        autotp_shard(tiny("bert"), None, injection_policy={"BertLayer": (1,)})
    return {"gpt2": (attn.num_heads, attn.split_size, attn.head_dim),
            "bert": (self_attn.num_attention_heads, self_attn.all_head_size, self_attn.attention_head_size),
            "llama_kv": tuple(llama.model.layers[0].self_attn.k_proj.weight.shape),
            "rank": dist.get_rank()}


def test_attention_modules_compute_with_their_local_heads():
    results = run_distributed(_head_counts_and_errors, world_size=2, timeout=120)
    for r in results:
        assert r["gpt2"] == (2, 16, 8)  # 4 heads of 8 -> 2 local heads, split_size 16
        assert r["bert"] == (2, 16, 8)
        assert r["llama_kv"] == (8, 32)  # 2 kv heads of 8 -> one per rank


def test_shard_sizes_follow_heads_then_grain():
    meta = ShardMeta(tp_size=2, num_kv_heads=2, tp_grain_size=64)
    assert shard_sizes(32, meta, by_heads=True) == [16, 16]
    assert shard_sizes(96, ShardMeta(tp_size=2, num_kv_heads=3), by_heads=True) == [64, 32]  # whole heads
    assert shard_sizes(320, meta, by_heads=False) == [192, 128]  # 5 grains of 64
    assert shard_sizes(200, meta, by_heads=False) == [128, 72]  # 3 grains + tail 8 on the last rank
    assert shard_sizes(33, meta, by_heads=False) == [17, 16]  # smaller than the grains: near even
    # fewer heads than ranks: the trailing ranks hold none (DeepSpeed 0.19.8)
    assert shard_sizes(16, ShardMeta(tp_size=4, num_kv_heads=2), by_heads=True) == [8, 8, 0, 0]
    layout = make_layout([4, 2, 2], ShardMeta(tp_size=2, num_kv_heads=2), by_heads=True)  # fused GQA q|k|v
    assert layout.pieces == (((0, 2), (4, 1), (6, 1)), ((2, 2), (5, 1), (7, 1)))
    full = torch.arange(8.0)
    assert layout.take(full, 1, 0).tolist() == [2.0, 3.0, 5.0, 7.0]


def test_layer_specs_and_hf_plan():
    spec = TPLayerSpec(patterns=[r".*\.qkv_proj\.weight$"], partition_type="column", shape=[[8, 4, 4], -1],
                       partition_dim=0, model_types=["llama"])
    assert spec.partition_type is PartitionType.COLUMN
    assert spec.matches("model.layers.0.self_attn.qkv_proj.weight", "LLAMA")
    assert not spec.matches("model.layers.0.self_attn.qkv_proj.weight", "qwen2")
    assert spec.sub_sizes(16) == [8, 4, 4]
    with pytest.raises(ValueError, match="do not add up"):
        spec.sub_sizes(20)
    assert TPLayerSpec(patterns=["x"], shape=[2, -1], partition_dim=0).sub_sizes(10) == [5, 5]
    # partition_dim left out: the split dimension (0 for column), as DeepSpeed; the packing is not ignored
    assert TPLayerSpec(patterns=["x"], shape=[2, -1]).sub_sizes(10) == [5, 5]
    assert TPLayerSpec(patterns=["x"], partition_type="row", shape=[-1, 2]).sub_sizes(10) == [5, 5]
    assert TPLayerSpec(patterns=["x"], partition_type="ROW").partition_type is PartitionType.ROW
    with pytest.raises(ValueError, match=r"partition_type 'diagonal'.*accepted: \['column', 'row', 'skip'\]"):
        TPLayerSpec(patterns=["x"], partition_type="diagonal")
    with pytest.raises(ValueError, match="partition_dim 2 is out of range"):
        TPLayerSpec(patterns=["x"], shape=[2, -1], partition_dim=2)
    with pytest.raises(ValueError, match="entry 0 at 0 is invalid"):
        TPLayerSpec(patterns=["x"], shape=[0, -1])
    config = AutoTPConfig.from_dict({"layer_specs": [{"patterns": ["a"], "partition_type": "row"}]})
    assert config.find_matching_spec("a").partition_type is PartitionType.ROW
    specs = hf_tp_plan_specs({"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"})
    assert specs[0].matches("model.layers.3.self_attn.q_proj.weight")
    assert not specs[0].matches("model.layers.3.self_attn.q_proj_extra.weight")
    assert specs[1].partition_type is PartitionType.ROW
    assert hf_tp_plan_specs({"lm_head": "colwise_gather_output"})[0].gather_output
    with pytest.raises(ValueError, match="local_colwise"):
        hf_tp_plan_specs({"lm_head": "local_colwise"})
    with pytest.raises(ValueError, match="invalid AutoTP layer spec pattern"):
        TPLayerSpec(patterns=["("])


@settings(max_examples=60, deadline=None)
@given(sub_sizes=st.lists(st.integers(1, 300), min_size=1, max_size=3), tp=st.integers(1, 4),
       grain=st.sampled_from([1, 8, 64]), heads=st.sampled_from([None, 1, 2, 4, 8]), by_heads=st.booleans())
def test_every_layout_tiles_the_dimension(sub_sizes, tp, grain, heads, by_heads):
    meta = ShardMeta(tp_size=tp, num_kv_heads=heads, tp_grain_size=grain)
    try:
        layout = make_layout(sub_sizes, meta, by_heads=by_heads)
    except ValueError as exc:  # only when some rank would get nothing
        assert "cannot shard" in str(exc)
        return
    full = torch.arange(float(sum(sub_sizes)))
    shards = [layout.take(full, rank, 0) for rank in range(tp)]
    # an empty shard only where whole heads are fewer than the ranks
    assert [len(s) for s in shards] == layout.sizes and (all(layout.sizes) or (by_heads and heads < tp))
    assert sorted(torch.cat(shards).tolist()) == full.tolist()  # every entry exactly once
    for rank, shard in enumerate(shards):  # each sub-parameter contributes a contiguous piece, in order
        assert [length for _, length in layout.pieces[rank]] and len(layout.pieces[rank]) == len(sub_sizes)
        assert shard.tolist() == [i for start, n in layout.pieces[rank] for i in range(start, start + n)]
