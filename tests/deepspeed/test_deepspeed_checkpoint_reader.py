"""``deepspeed.checkpoint.DeepSpeedCheckpoint`` / ``ZeROCheckpoint`` / ``model_3d_desc``: a checkpoint folder read
at a smaller pipeline x tensor x data layout (Megatron-DeepSpeed's reshaping), on a Megatron-style folder written
here and on a ZeRO-2 checkpoint written by this project's engine on 2 ranks."""

from __future__ import annotations

import os

import pytest
import torch
from _harness import run_distributed

from deepspeed.checkpoint import (
    CHECKPOINT_PARALLEL_DIMS,
    DeepSpeedCheckpoint,
    ZeROCheckpoint,
    get_model_3d_descriptor,
    merge_state,
    model_3d_desc,
)
from deepspeed.checkpoint.ds_to_universal import _aggregate_autoep_zero12_metadata
from deepspeed.checkpoint.reshape_meg_2d import reshape_meg_2d_parallel
from deepspeed.checkpoint.utils import checkpoint_parallel_metadata


def test_2d_contraction_merges_neighbouring_slices_then_stages():
    # 2 stages x 4 slices; source rank i = stage i // 4, slice i % 4
    m = reshape_meg_2d_parallel(old_pp_degree=2, old_tp_degree=4, new_pp_degree=1, new_tp_degree=2)
    assert m.get_data(0, 0) == [0, 1, 4, 5] and m.get_data(0, 1) == [2, 3, 6, 7]


def test_3d_contraction_spreads_data_parallel_shards():
    src = model_3d_desc(pp_degree=2, tp_degree=2, dp_degree=2)
    maps = src.reshape(model_3d_desc(pp_degree=1, tp_degree=1, dp_degree=2))
    # position (0,0) takes model ranks 0..3 of both data-parallel ranks (shard d*4+m), split in two runs
    assert [two_d.get_data(0, 0) for two_d in maps] == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert src.world_size() == 8 and src.get_desc() == "PP,TP,DP = (2, 2, 2)"


def test_expansion_is_refused_with_the_dimension_named():
    ok, errors = model_3d_desc(1, 2, 1).can_reshape(model_3d_desc(2, 1, 1))
    assert not ok and errors == ["Expansion reshape not supported - PP: 1 ---> 2"]
    with pytest.raises(AssertionError, match="Expansion reshape not supported - PP"):
        model_3d_desc(1, 2, 1).reshape(model_3d_desc(2, 1, 1))


def test_merge_state_concatenates_tensors_and_keeps_scalars():
    a = {"w": torch.ones(2), "n": 3, "l": [torch.zeros(1)], "only_a": 1}
    b = {"w": torch.zeros(1), "n": 4, "l": [torch.ones(2)], "only_b": 2}
    merged = merge_state(a, b)
    assert merged["w"].tolist() == [1, 1, 0] and merged["n"] == 3 and merged["l"][0].tolist() == [0, 1, 1]
    assert merged["only_a"] == 1 and merged["only_b"] == 2
    with pytest.raises(ValueError, match="Cannot merge two states"):
        merge_state({"x": 1}, {"x": torch.ones(1)})


def _megatron_folder(path, recorded: bool) -> dict:
    """tp=2, pp=1, dp=2: layer_01 embedding, layer_03/04 transformer layers, layer_05 final norm."""
    torch.manual_seed(0)
    weights = {}
    for tp in range(2):
        state = {"iteration": 7, "args": {"seq_length": 8}, "param_shapes": [{"w": torch.Size([2])}]}
        if recorded:
            state.update(checkpoint_parallel_metadata(None) | {CHECKPOINT_PARALLEL_DIMS: {"pp_degree": 1,
                                                                                          "tp_degree": 2}})
        torch.save(state, os.path.join(path, f"mp_rank_{tp:02d}_model_states.pt"))
        def transformer(tp: int = tp):
            return {"self_attention.dense.weight": torch.randn(4, 2), "mlp.dense_h_to_4h.weight": torch.randn(2, 4),
                    "input_layernorm.weight": torch.full((4,), float(tp))}

        layers = {"01": {"word_embeddings.weight": torch.randn(3, 4)}, "03": transformer(), "04": transformer(),
                  "05": {"weight": torch.full((4,), 1.0 + tp)}}
        for layer, sd in layers.items():
            torch.save(sd, os.path.join(path, f"layer_{layer}-model_{tp:02d}-model_states.pt"))
            weights[(layer, tp)] = sd
        for dp in range(2):
            padding = 1 if dp == 1 else 0  # the last data-parallel rank's flat partition is padded
            exp_avg = torch.arange(4.0) + 10 * (2 * tp + dp)
            optim = {"optimizer_state_dict": {
                "base_optimizer_state": {"state": {0: {"exp_avg": exp_avg, "step": torch.tensor(3.0)}}},
                "group_paddings": [padding], "partition_count": [2]}, "param_shapes": "dropped"}
            torch.save(optim, os.path.join(path, f"zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt"))
    return weights


@pytest.mark.parametrize("recorded", [True, False])
def test_megatron_folder_read_at_tp1_dp1(tmp_path, recorded):
    weights = _megatron_folder(str(tmp_path), recorded)
    assert (lambda d: (d.pp_degree, d.tp_degree, d.dp_degree))(get_model_3d_descriptor(str(tmp_path))) == (1, 2, 2)
    ckpt = DeepSpeedCheckpoint(str(tmp_path), tp_degree=1, dp_degree=1)
    assert (ckpt.original_world_size, ckpt.world_size) == (4, 1)
    assert ckpt.layer_keys == ["layer_01", "layer_03", "layer_04", "layer_05"]
    assert ckpt.get_iteration() == 7 and ckpt.get_args() == {"seq_length": 8}
    assert ckpt.get_pp_transformer_map(0) == ["layer_03", "layer_04"]
    assert [os.path.basename(f) for f in ckpt.get_2d_parallel_files(tp_index=0, pp_index=0)] == [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    emb = ckpt.get_embedding_state(0)["word_embeddings.weight"]
    assert torch.equal(emb, torch.cat([weights[("01", 0)]["word_embeddings.weight"],
                                       weights[("01", 1)]["word_embeddings.weight"]]))
    first = ckpt.get_transformer_state(tp_index=0, pp_index=0)[0]
    assert torch.equal(first["self_attention.dense.weight"],  # row-parallel: slices side by side
                       torch.cat([weights[("03", t)]["self_attention.dense.weight"] for t in range(2)], dim=1))
    assert torch.equal(first["mlp.dense_h_to_4h.weight"],
                       torch.cat([weights[("03", t)]["mlp.dense_h_to_4h.weight"] for t in range(2)], dim=0))
    assert first["input_layernorm.weight"].tolist() == [0.0] * 4  # whole on every slice: the first one's
    assert ckpt.get_final_norm_state(0)["weight"].tolist() == [1.0] * 4
    # the one new rank reads all 4 shards (shard d*2+t), paddings cut, partition count the new dp degree
    files = [os.path.basename(f) for f in ckpt.get_zero_files(0, 0, 0)]
    assert files == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                     "zero_pp_rank_0_mp_rank_01_optim_states.pt", "zero_pp_rank_1_mp_rank_01_optim_states.pt"]
    state = ckpt.get_zero_checkpoint_state(0, 0, 0)
    assert "param_shapes" not in state
    assert state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"].tolist() == [
        0, 1, 2, 3, 10, 11, 12, 20, 21, 22, 23, 30, 31, 32]
    assert state["optimizer_state_dict"]["partition_count"] == [1]
    assert state["optimizer_state_dict"]["group_paddings"] == [0]


def test_model_state_files_read_once_and_metadata_checked(tmp_path, monkeypatch):
    _megatron_folder(str(tmp_path), recorded=True)
    loads, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda path, *a, **k: loads.append(os.path.basename(str(path)))
                        or real_load(path, *a, **k))
    ckpt = DeepSpeedCheckpoint(str(tmp_path))
    assert loads == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    shapes, autoep, ordering = _aggregate_autoep_zero12_metadata(ckpt.model_state_metadata)
    assert shapes == [{"w": torch.Size([2])}] * 2 and autoep is None and ordering is False
    bad = [(f, dict(m, ds_autoep_layers="x")) for f, m in ckpt.model_state_metadata]
    with pytest.raises(RuntimeError, match="AutoEP metadata must be a list in .*mp_rank_00"):
        _aggregate_autoep_zero12_metadata(bad)


def test_bad_folders_are_named(tmp_path):
    with pytest.raises(AssertionError, match="path does not exist"):
        DeepSpeedCheckpoint(str(tmp_path / "missing"))
    with pytest.raises(AssertionError, match="Cannot find mp_rank_"):
        DeepSpeedCheckpoint(str(tmp_path))
    torch.save({}, tmp_path / "mp_rank_00_model_states.pt")
    with pytest.raises(AssertionError, match="No ZeRO files found"):
        ZeROCheckpoint(str(tmp_path))


def test_checkpoint_parallel_metadata_reads_megatron_and_deepspeed_units():
    class Megatron:
        def get_pipeline_model_parallel_world_size(self):
            return 3

        def get_tensor_model_parallel_world_size(self):
            return 2

    class Grid:
        def get_pipe_parallel_world_size(self):
            return 2

        def get_slice_parallel_world_size(self):
            return 4

    from deepspeed.runtime.engine import _checkpoint_parallel_metadata

    assert _checkpoint_parallel_metadata(None) == {CHECKPOINT_PARALLEL_DIMS: {"pp_degree": 1, "tp_degree": 1}}
    assert checkpoint_parallel_metadata(Megatron())[CHECKPOINT_PARALLEL_DIMS] == {"pp_degree": 3, "tp_degree": 2}
    assert checkpoint_parallel_metadata(Grid())[CHECKPOINT_PARALLEL_DIMS] == {"pp_degree": 2, "tp_degree": 4}


def _zero2_save(save_dir: str) -> int:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    config = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 2}}
    engine = deepspeed.initialize(model=model, config=config)[0]
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 5)).sum())
        engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    return sum(p.numel() for p in model.parameters())


def test_engine_zero2_checkpoint_read_at_dp1(tmp_path):
    numel = run_distributed(_zero2_save, world_size=2, args=(str(tmp_path),), timeout=120)[0]
    ckpt = DeepSpeedCheckpoint(str(tmp_path / "t"))
    assert (ckpt.pp_degree, ckpt.tp_degree, ckpt.dp_degree) == (1, 1, 2)
    whole = DeepSpeedCheckpoint(str(tmp_path / "t"), dp_degree=1)
    state = whole.get_zero_checkpoint_state(0, 0, 0)["optimizer_state_dict"]
    exp_avg = state["base_optimizer_state"]["state"][0]["exp_avg"]
    assert exp_avg.numel() == numel  # both ranks' partitions, the padding cut off
    assert state["partition_count"] == [1]
