"""The Hugging Face tp_plan styles of a model's output side: ``embedding_rowwise`` (the embedding stays whole, or is
split along the vocabulary together with a tied output head) and a gathered ``lm_head`` over an uneven vocabulary.
Every sharded run is compared with the unsharded model: outputs and gathered gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed
from torch import nn

from ds_inference.autotp import (
    LinearLayer,
    PartitionType,
    VocabParallelEmbedding,
    autotp_shard,
    full_state_dict,
    hf_tp_plan_specs,
)
from ds_inference.autotp.tp_plan_converter import TPPlanConverter

VOCAB, HIDDEN = 11, 6  # 11 rows over 2 ranks: shards of 6 and 5 (uneven on purpose)


class _LM(nn.Module):
    """embed -> up (column) -> down (row) -> lm_head, the head tied to the embedding or not."""

    def __init__(self, tied: bool, padding_idx: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN, padding_idx=padding_idx)
        self.up = nn.Linear(HIDDEN, 8)
        self.down = nn.Linear(8, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, ids):
        return self.lm_head(self.down(self.up(self.embed(ids)).relu()))


PLAN = {"embed": "embedding_rowwise", "up": "colwise", "down": "rowwise", "lm_head": "colwise_gather_output"}


def test_embedding_rowwise_converts_to_a_vocab_parallel_skip_spec():
    for specs in (TPPlanConverter.convert({"model.embed_tokens": "embedding_rowwise"}),
                  hf_tp_plan_specs({"model.embed_tokens": "embedding_rowwise"})):
        (spec,) = specs
        assert spec.partition_type is PartitionType.SKIP
        assert spec.vocab_parallel and not spec.grad_allreduce and not spec.gather_output
        assert spec.matches("model.embed_tokens.weight")


def _sharded_vs_full(tied: bool, padding_idx: int | None, converter: bool) -> dict:
    torch.manual_seed(0)
    full = _LM(tied, padding_idx)
    ids = torch.tensor([[0, 3, 5, 6, 10, 2], [7, 7, 1, 9, 4, 0]])
    reference = full(ids)
    reference.square().sum().backward()
    model = _LM(tied, padding_idx)
    model.load_state_dict(full.state_dict())
    specs = TPPlanConverter.convert(PLAN) if converter else hf_tp_plan_specs(PLAN)
    autotp_shard(model, dist.group.WORLD, layer_specs=specs, tp_grain_size=1, keep_module_on_host=True)
    out = model(ids)
    out.square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, layer in ((n, m) for n, m in model.named_modules() if hasattr(m, "gather_params")):
        for pname, param in layer.named_parameters(recurse=False):
            dim = layer.partition_dims().get(pname)
            if dim is not None:
                grads[f"{name}.{pname}"] = layer._tp_layouts[pname].gather(param.grad, dim, dist.group.WORLD)
    full_grads = dict(full.named_parameters(remove_duplicate=False))
    return {
        "types": (type(model.embed).__name__, type(model.lm_head).__name__),
        "shapes": (tuple(model.embed.weight.shape), tuple(model.lm_head.weight.shape)),
        "shared": model.lm_head.weight is model.embed.weight,
        "out": torch.allclose(out, reference, atol=1e-5),
        "grads": all(torch.allclose(grads[n], full_grads[n].grad, atol=1e-5) for n in grads),
        "state": all(torch.equal(v, full.state_dict()[k]) for k, v in full_state_dict(model).items()),
    }


@pytest.mark.parametrize("converter", [True, False], ids=["converter", "hf_specs"])
def test_tied_head_and_embedding_split_along_the_vocabulary(converter):
    results = run_distributed(_sharded_vs_full, world_size=2, args=(True, 3, converter), timeout=60)
    for rank, result in enumerate(results):
        # one shard of the vocabulary (6 + 5 rows), shared by both layers, the logits gathered; outputs, every
        # gradient (the shared weight's from both uses) and the gathered weights equal the unsharded model's
        assert result["types"] == ("VocabParallelEmbedding", "LinearLayer")
        assert result["shapes"] == (((6, HIDDEN),) * 2, ((5, HIDDEN),) * 2)[rank]
        assert result["shared"] and result["out"] and result["grads"] and result["state"]


def test_untied_embedding_rowwise_stays_whole_and_the_head_is_gathered():
    results = run_distributed(_sharded_vs_full, world_size=2, args=(False, None, True), timeout=60)
    for rank, result in enumerate(results):
        assert result["types"] == ("Embedding", "LinearLayer")
        assert result["shapes"] == ((VOCAB, HIDDEN), ((6, HIDDEN), (5, HIDDEN))[rank])
        assert not result["shared"] and result["out"] and result["grads"] and result["state"]


def _vocab_layer_facts() -> tuple:
    model = _LM(True, padding_idx=8)
    autotp_shard(model, dist.group.WORLD, layer_specs=hf_tp_plan_specs(PLAN), tp_grain_size=1,
                 keep_module_on_host=True)
    embed = model.embed
    assert isinstance(embed, VocabParallelEmbedding) and isinstance(model.lm_head, LinearLayer)
    return embed.vocab_start_index, embed.vocab_end_index, embed.padding_idx, model.lm_head.gather_output


def test_vocab_ranges_and_the_local_padding_index():
    # rank 1 holds rows 6..10, so the padding row 8 is its local row 2; rank 0 has no padding row
    assert run_distributed(_vocab_layer_facts, world_size=2, timeout=60) == [(0, 6, None, True), (6, 11, 2, True)]


class _ScaledEmbedding(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2.0


def _custom_embedding_stays_whole() -> tuple:
    import warnings

    model = _LM(True)
    model.embed = _ScaledEmbedding(VOCAB, HIDDEN)
    model.lm_head.weight = model.embed.weight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autotp_shard(model, dist.group.WORLD, layer_specs=hf_tp_plan_specs(PLAN), tp_grain_size=1,
                     keep_module_on_host=True)
    return (type(model.embed).__name__, type(model.lm_head).__name__, model.lm_head.weight is model.embed.weight,
            any("has its own forward" in str(w.message) for w in caught))


def test_an_embedding_with_its_own_forward_keeps_the_tied_pair_whole():
    assert run_distributed(_custom_embedding_stays_whole, world_size=2, timeout=60) == [
        ("_ScaledEmbedding", "Linear", True, True)] * 2


def _llama_over_three_ranks() -> tuple:
    import warnings

    from _autotp_models import ids, output, tiny

    full = tiny("llama")  # 4 attention heads, 2 key/value heads
    tokens = ids()
    reference = output(full, tokens)
    model = tiny("llama")
    plan = {**model.config.base_model_tp_plan, "lm_head": "colwise_gather_output"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autotp_shard(model, dist.group.WORLD, layer_specs=hf_tp_plan_specs(plan), tp_grain_size=1,
                     keep_module_on_host=True)
    out = output(model, tokens)
    out.square().sum().backward()
    attention = model.model.layers[0].self_attn
    return (attention.q_proj.weight.shape[0], attention.k_proj.weight.shape[0], attention.o_proj.weight.shape[1],
            torch.allclose(out, reference, atol=1e-5), any("exceeds the model's 2 key/value heads" in str(w.message)
                                                           for w in caught))


def test_more_ranks_than_kv_heads_leaves_the_last_rank_without_attention():
    # head_dim 8: ranks 0 and 1 hold one kv head (2 query heads) each, rank 2 none; the logits stay exact
    assert run_distributed(_llama_over_three_ranks, world_size=3, timeout=90) == [
        (16, 8, 16, True, True), (16, 8, 16, True, True), (0, 0, 0, True, True)]
