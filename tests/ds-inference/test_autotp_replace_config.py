"""``AutoTP._replace_module`` with a ``partition_config``: each module with a 2-D weight is matched by its full
path from the model, replaced as its spec says (column, row, skip, gathered column), embeddings split only when a
spec names them, and a gathered output head tied to the embedding at run time left replicated with it."""

from __future__ import annotations

import pytest
from torch import nn


def _model(tied: bool) -> nn.Module:
    model = nn.Module()
    model.embed_tokens = nn.Embedding(10, 8)
    block = nn.Module()
    block.q_proj, block.o_proj, block.k_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
    model.layers = nn.ModuleList([nn.ModuleDict({"attn": block})])
    model.lm_head = nn.Linear(8, 10, bias=False)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def _autotp(model: nn.Module):
    from ds_inference.autotp import AutoTP, AutoTPConfig, PartitionType, TPLayerSpec

    config = AutoTPConfig(layer_specs=[
        TPLayerSpec(patterns=[r"^layers\.0\.attn\.q_proj\.weight$"], partition_type=PartitionType.COLUMN),
        TPLayerSpec(patterns=[r".*o_proj\.weight$"], partition_type=PartitionType.ROW),
        TPLayerSpec(patterns=[r".*k_proj\.weight$"], partition_type=PartitionType.SKIP),
        TPLayerSpec(patterns=[r".*lm_head\.weight$"], partition_type=PartitionType.COLUMN, gather_output=True),
    ])
    autotp = AutoTP(module=model, all_reduce_linears=[], partition_config=config)
    autotp.set_tensor_parallel_config(1, None)
    autotp.update_linear_policies()
    return autotp


def test_specs_see_full_paths_and_choose_the_layer():
    from ds_inference.autotp import LinearAllreduce, LinearLayer

    model = _model(tied=False)
    k_proj = model.layers[0]["attn"].k_proj
    _autotp(model)._replace_module(model)
    attn = model.layers[0]["attn"]
    assert type(attn.q_proj) is LinearLayer and not attn.q_proj.gather_output
    assert type(attn.o_proj) is LinearAllreduce
    assert attn.k_proj is k_proj and k_proj.replaced  # skip: matched, kept
    assert type(model.lm_head) is LinearLayer and model.lm_head.gather_output
    assert type(model.embed_tokens) is nn.Embedding  # no spec names it


def test_gathered_head_tied_at_run_time_stays_replicated():
    model = _model(tied=True)
    with pytest.warns(UserWarning, match="tied to 'embed_tokens.weight'"):
        _autotp(model)._replace_module(model)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.embed_tokens.weight


def test_update_linear_policies_follows_linear_layer_setting():
    from ds_inference.autotp import AutoTP

    autotp = AutoTP(module=nn.Linear(2, 2), all_reduce_linears=[], linear_layer_setting=(nn.Linear, nn.Embedding))
    autotp.update_linear_policies()
    assert autotp.linear_policies == {nn.Linear: "linear", nn.Embedding: "embedding"}
    assert not autotp.conv_linear_layer
