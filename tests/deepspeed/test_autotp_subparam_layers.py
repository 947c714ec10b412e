"""DeepSpeed's sub-parameter AutoTP layers (``SubParamLinearLayer``/``SubParamLinearAllreduce``,
``GateUpPack_LinearLayer``) built over our LinearLayer/LinearAllreduce: over 2 gloo ranks each rank keeps one
piece of every packed sub-parameter, the sharded layers compute what the unsharded ones compute, gather gives the
full weight back, and the universal-checkpoint metadata they publish restores each rank's shard exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed


def _body() -> dict:
    from deepspeed.checkpoint.universal_checkpoint import _resolve_autotp_partition
    from ds_inference.autotp import GateUpPack_LinearLayer, SubParamLinearAllreduce, SubParamLinearLayer
    from ds_inference.autotp.uc_meta import DS_AUTOTP_UC_META

    rank = dist.get_rank()
    torch.manual_seed(0)
    qkv, out_proj = torch.nn.Linear(4, 10), torch.nn.Linear(6, 3)  # q=6, k=2, v=2 packed in 10 rows
    col = SubParamLinearLayer(copy.deepcopy(qkv), dist.group.WORLD, shape=((6, 2, 2), -1), partition_dim=0,
                              name="qkv")
    rows = [0, 1, 2, 6, 8] if rank == 0 else [3, 4, 5, 7, 9]  # q 3+3, k 1+1, v 1+1
    x = torch.randn(2, 4)
    res = {"col_shape": tuple(col.weight.shape),
           "col_rows": torch.equal(col.weight, qkv.weight[rows]) and torch.equal(col.bias, qkv.bias[rows]),
           "col_forward": torch.allclose(col(x), qkv(x)[:, rows].detach(), atol=1e-6)}
    full = {}
    for pname in ("weight", "bias"):
        param = getattr(col, pname)
        restored = _resolve_autotp_partition(param, {}, getattr(qkv, pname).detach().flatten(), rank, 2)
        full[pname] = torch.equal(restored, param.detach().flatten())
    res["restore"] = full
    gathered = col.gather_params()
    res["gather"] = torch.equal(gathered["weight"], qkv.weight) and torch.equal(gathered["bias"], qkv.bias)
    res["widths"] = getattr(col.weight, DS_AUTOTP_UC_META)["sub_param_shard_widths"]

    row = SubParamLinearAllreduce(copy.deepcopy(out_proj), dist.group.WORLD, shape=(3, (4, 2)), partition_dim=1,
                                  name="o")
    cols = [0, 1, 4] if rank == 0 else [2, 3, 5]
    h = torch.randn(2, 6)
    res["row_forward"] = torch.allclose(row(h[:, cols]), out_proj(h).detach(), atol=1e-6)
    res["row_bias_replicated"] = torch.equal(row.bias, out_proj.bias)

    gate_up = torch.nn.Linear(3, 8, bias=False)
    packed = GateUpPack_LinearLayer(copy.deepcopy(gate_up), dist.group.WORLD, name="dense_h_to_4h")
    mine = [0, 1, 4, 5] if rank == 0 else [2, 3, 6, 7]
    res["gate_up"] = torch.equal(packed.weight, gate_up.weight[mine])
    return res


def test_subparam_layers_shard_compute_gather_and_restore_per_sub_parameter():
    r0, r1 = run_distributed(_body, world_size=2, timeout=90)
    for res in (r0, r1):
        assert res["col_shape"] == (5, 4)
        assert res["col_rows"] and res["col_forward"] and res["gather"]
        assert res["restore"] == {"weight": True, "bias": True}
        assert res["widths"] == [[3, 3], [1, 1], [1, 1]]
        assert res["row_forward"] and res["row_bias_replicated"] and res["gate_up"]


def test_view_spec_errors_name_the_layer_and_the_accepted_values():
    from ds_inference.autotp import SubParamLinearLayer

    with pytest.raises(ValueError, match=r"'qkv'.*cannot view a weight of 48 elements"):
        SubParamLinearLayer(torch.nn.Linear(4, 12), None, shape=((5, 5), -1), partition_dim=0, name="qkv")
    with pytest.raises(ValueError, match=r"'qkv'.*dimension 0 of 12 does not split into 5 equal"):
        SubParamLinearLayer(torch.nn.Linear(4, 12), None, shape=(5, -1), partition_dim=0, name="qkv")
    with pytest.raises(ValueError, match="partition_dim=2; accepted: 0..1"):
        SubParamLinearLayer(torch.nn.Linear(4, 12), None, shape=(3, -1), partition_dim=2, name="qkv")


def test_widths_setter_refuses_widths_that_do_not_tile_and_keeps_the_old_split():
    from ds_inference.autotp import SubParamLinearLayer

    layer = SubParamLinearLayer(torch.nn.Linear(4, 12), None, shape=(3, -1), partition_dim=0, name="qkv")
    layer.tp_world_size = 2
    layer._subparam_shard_widths = [[2, 2], [3, 1], [4, 0]]
    with pytest.raises(ValueError, match=r"shard widths \[3, 2\].*summing to 4"):
        layer._subparam_shard_widths = [[2, 2], [3, 2], [4, 0]]
    assert layer._subparam_shard_widths == [[2, 2], [3, 1], [4, 0]]
    assert layer._partition_sizes == (9, 3)


def test_layout_widths_reads_back_make_layout_and_refuses_other_layouts():
    from ds_inference.autotp.sharding import ShardLayout, ShardMeta, make_layout
    from ds_inference.autotp.split_rules import layout_widths

    layout = make_layout([8, 4, 4], ShardMeta(tp_size=2, num_kv_heads=2), by_heads=True)
    assert layout_widths(layout) == ((8, 4, 4), [[4, 4], [2, 2], [2, 2]])
    reversed_ranks = ShardLayout(full=4, pieces=(((2, 2),), ((0, 2),)))  # rank 1 holds the first block
    assert layout_widths(reversed_ranks) is None


def test_uc_meta_format_strings_match_deepspeeds_checkpoint_constants():
    from deepspeed.checkpoint import constants
    from ds_inference.autotp import uc_meta

    assert uc_meta.DS_AUTOTP_UC_META == constants.DS_AUTOTP_UC_META
    assert uc_meta.UC_VERSION_KEY == constants.UNIVERSAL_CHECKPOINT_VERSION_KEY
    assert uc_meta.UC_VERSION == constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE


def test_hand_built_layers_split_by_tp_shard_facts():
    from deepspeed.module_inject import tp_shard
    from deepspeed.module_inject.layers import LinearLayer, _subparam_shard_widths

    saved = tp_shard.num_kv_heads, tp_shard.tp_grain_size
    try:
        tp_shard.set_num_kv_heads(3)
        assert _subparam_shard_widths((12, 4), 2, "qkv") == [[8, 4], [2, 2]]  # 12 = 3 heads: 2 + 1; 4 not by heads
        tp_shard.set_num_kv_heads(None)
        tp_shard.set_tp_grain_size(4)
        layer = LinearLayer(torch.nn.Linear(2, 13), mp_group=None, name="mlp.up")
        layer.tp_world_size = 2
        assert layer._freeze_partition_sizes(13) == (8, 5)  # three grains of 4: 2 + 1, the tail 1 on the last
    finally:
        tp_shard.set_num_kv_heads(saved[0])
        tp_shard.set_tp_grain_size(saved[1])


def test_fused_qwen_projection_sets_the_rank_query_width_and_refuses_an_empty_rank():
    from deepspeed.module_inject import tp_shard
    from deepspeed.module_inject.layers import fused_LinearLayer

    class QWenBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = torch.nn.Module()
            self.attn.split_size = 8

    saved = tp_shard.num_kv_heads
    try:
        tp_shard.set_num_kv_heads(2)
        tp_shard.set_n_embd(None)
        block = QWenBlock()
        layer = fused_LinearLayer(torch.nn.Linear(8, 24, bias=False), None, skip_partition=True,
                                  fused_module=block, name="c_attn")
        layer.tp_world_size, layer.tp_index = 2, 1
        layer._freeze_partition_sizes(24)
        assert block.attn.split_size == 4 and layer._subparam_shard_widths == [[4, 4]] * 3
        assert not list(layer.children())  # the block (which holds the layer) is not its submodule
        layer.tp_world_size, layer.tp_index = 4, 3
        with pytest.raises(RuntimeError, match="rank 3 would hold an empty query/key/value shard"):
            layer._freeze_partition_sizes(24)
    finally:
        tp_shard.set_num_kv_heads(saved)


def _rules_body() -> dict:
    from deepspeed.checkpoint import constants as c
    from deepspeed.checkpoint.autotp_universal import universal_checkpoint_info
    from deepspeed.module_inject.layers import collect_autotp_universal_checkpoint_info
    from deepspeed.runtime.autotp import autotp_layouts
    from ds_inference.autotp import HiddenParallelEmbedding, LinearAllreduce, LinearLayer
    from ds_inference.autotp.sharding import ShardMeta, make_layout

    meta = ShardMeta(tp_size=2, num_kv_heads=2)
    model = torch.nn.Module()
    model.emb = HiddenParallelEmbedding(torch.nn.Embedding(10, 6), dist.group.WORLD,
                                        make_layout([6], meta, by_heads=False), name="emb")
    model.qkv = LinearLayer(torch.nn.Linear(6, 10), dist.group.WORLD, make_layout([6, 2, 2], meta, by_heads=True),
                            name="qkv")
    model.o = LinearAllreduce(torch.nn.Linear(6, 6), dist.group.WORLD, make_layout([6], meta, by_heads=True),
                              name="o")
    model.norm = torch.nn.LayerNorm(6)
    ours = collect_autotp_universal_checkpoint_info(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    by_layouts = universal_checkpoint_info(autotp_layouts(model), shapes)
    keys = (c.TP_REPLICATED_PARAMETER_PATTERNS, c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, c.SUB_PARAM_SHARD_WIDTHS)
    return {"same": {k: sorted(map(str, ours[k])) == sorted(map(str, by_layouts[k])) for k in keys},
            "fused": [(e["patterns"], e["shape"][0]) for e in ours[c.PARAMETER_WITH_SUB_PARAMS]],
            "row": ours[c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS]}


def test_collected_rules_agree_with_the_rules_derived_from_autotp_layouts():
    for res in run_distributed(_rules_body, world_size=2, timeout=90):
        assert all(res["same"].values()), res["same"]
        assert res["fused"] == [([r"^qkv\.weight$"], (6, 2, 2)), ([r"^qkv\.bias$"], (6, 2, 2))]
        assert res["row"] == [r"^emb\.weight$", r"^o\.weight$"]
