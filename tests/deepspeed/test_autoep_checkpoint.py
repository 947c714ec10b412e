"""AutoEP checkpoints (ZeRO-1/2): saved at ``autoep_size`` 2, converted by ``ds_to_universal``, loaded at
``autoep_size`` 1 and 2; the steps after the load give the losses of the uninterrupted run. Plus the layout
(``ds_autoep_layers``, per-expert files, universal expert files holding every expert) and the errors for bad
metadata."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _harness import run_distributed

transformers = pytest.importorskip("transformers")

BEFORE, AFTER = 2, 2


def _mixtral():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=24, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.MixtralForCausalLM(config)


def _engine(ep_size: int, stage: int, universal: bool = False, data_first: bool = False):
    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "gradient_clipping": 1.0,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage},
           "expert_parallel": {"enabled": True, "autoep_size": ep_size, "preset_model": "mixtral"}}
    if data_first:
        cfg["use_data_before_expert_parallelism"] = True
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=_mixtral(), config=cfg)
    return engine


def _steps(engine, first: int, count: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
        ids = torch.randint(0, 32, (2, 9), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _resume(save_dir: str, stage: int, data_first: bool) -> dict:
    from deepspeed.checkpoint.ds_to_universal import main as convert

    engine = _engine(2, stage, data_first=data_first)
    _steps(engine, 0, BEFORE)
    engine.save_checkpoint(save_dir, tag="ep2")
    reference = _steps(engine, BEFORE, AFTER)
    dist.barrier()
    if dist.get_rank() == 0:
        convert(["--input_folder", os.path.join(save_dir, "ep2"), "--output_folder",
                 os.path.join(save_dir, "ep2_universal")])
    dist.barrier()
    out = {"reference": reference}
    for ep_size in (1, 2):
        restored = _engine(ep_size, stage, universal=True, data_first=data_first)
        restored.load_checkpoint(save_dir, tag="ep2_universal")
        out[ep_size] = _steps(restored, BEFORE, AFTER)
    same = _engine(2, stage, data_first=data_first)  # the plain checkpoint, same layout
    same.load_checkpoint(save_dir, tag="ep2")
    out["same"] = _steps(same, BEFORE, AFTER)
    return out


@pytest.mark.parametrize("stage,data_first", [(2, False), (1, True)], ids=["zero2-E+D", "zero1-D+E"])
def test_save_ep2_convert_load_ep1_and_ep2(tmp_path, stage, data_first):
    results = run_distributed(_resume, world_size=4, args=(str(tmp_path), stage, data_first), timeout=300)
    for rank in results:
        want = torch.tensor(rank["reference"])
        for key in (1, 2, "same"):
            torch.testing.assert_close(torch.tensor(rank[key]), want, rtol=1e-5, atol=1e-6, msg=f"{key}")
    tag = tmp_path / "ep2"
    files = sorted(os.listdir(tag))
    assert [f for f in files if f.startswith("layer_")] == sorted(
        f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in range(2) for e in range(4))
    state = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    layers = state["ds_autoep_layers"]
    assert [(e["moe_layer_id"], e["expert_key_prefix"], e["num_experts"], e["num_local_experts"], e["ep_size"])
            for e in layers] == [(i, f"model.layers.{i}.mlp.experts", 4, 2, 2) for i in range(2)]
    assert "model.layers.0.mlp.experts.w1" not in state["module"]  # the experts live in their own files
    expert = torch.load(tmp_path / "ep2_universal" / "zero" / "model.layers.1.mlp.experts.w2" / "exp_avg.pt",
                        weights_only=False)
    assert expert["is_expert_param"] and expert["ep_num_experts"] == 4 and expert["param"].shape == (4, 16, 24)
    assert torch.count_nonzero(expert["param"]) > 0


def _fragments(tmp_path, data_first: bool):
    from deepspeed.checkpoint.autoep_universal import (
        _zero12_fragment_path,
        consolidate_autoep_zero12_expert_states,
    )

    temp, out, name = str(tmp_path / "tmp"), str(tmp_path / "out"), "m.experts.w1"
    os.makedirs(os.path.join(temp, name, "0"))
    for d in range(4):  # 4 data-parallel ranks, ep 2: each holds one of its expert rank's 2 rows
        for i, key in enumerate(("fp32", "exp_avg", "exp_avg_sq")):
            torch.save(torch.full((3,), 10.0 * i + d), _zero12_fragment_path(temp, name, key, d))
        torch.save(torch.tensor(5), _zero12_fragment_path(temp, name, "step", d))
    meta = {name: {"num_experts": 4, "num_local_experts": 2, "ep_size": 2}}
    consolidate_autoep_zero12_expert_states(temp, out, meta, {name: (2, 3)}, 4, 1, data_first)
    return out, name


@pytest.mark.parametrize("data_first,order", [(False, [0, 2, 1, 3]), (True, [0, 1, 2, 3])])
def test_expert_rows_follow_the_expert_parallel_rank_order(tmp_path, data_first, order):
    out, name = _fragments(tmp_path, data_first)
    for i, key in enumerate(("fp32", "exp_avg", "exp_avg_sq")):
        saved = torch.load(os.path.join(out, "zero", name, f"{key}.pt"), weights_only=False)
        want = torch.tensor([[10.0 * i + d] * 3 for d in order])
        assert torch.equal(saved["param"], want) and saved["ep_num_experts"] == 4 and saved["cat_dim"] == 0
    assert int(torch.load(os.path.join(out, "zero", name, "step.pt"))) == 5


def test_bad_metadata_and_fragments_are_named(tmp_path):
    from deepspeed.checkpoint.autoep_universal import (
        AutoEPCheckpointError,
        _zero12_fragment_path,
        consolidate_autoep_zero12_expert_states,
        get_autoep_zero12_expert_param_info,
    )

    with pytest.raises(AutoEPCheckpointError, match="non-empty list"):
        get_autoep_zero12_expert_param_info(None)
    with pytest.raises(AutoEPCheckpointError, match=r"missing fields: \['num_local_experts', 'ep_size'\]"):
        get_autoep_zero12_expert_param_info([{"expert_key_prefix": "a.experts", "num_experts": 4}])
    with pytest.raises(AutoEPCheckpointError, match="num_experts=4, num_local_experts=3, ep_size=2"):
        get_autoep_zero12_expert_param_info([{"expert_key_prefix": "a", "num_experts": 4, "num_local_experts": 3,
                                              "ep_size": 2}])
    temp, name = str(tmp_path), "m.experts.w1"
    os.makedirs(os.path.join(temp, name, "0"))
    bad = _zero12_fragment_path(temp, name, "fp32", 0)
    torch.save(torch.zeros(3, dtype=torch.float16), bad)
    meta = {name: {"num_experts": 2, "num_local_experts": 1, "ep_size": 2}}
    with pytest.raises(AutoEPCheckpointError, match=f"must be FP32, got torch.float16 in {bad}"):
        consolidate_autoep_zero12_expert_states(temp, str(tmp_path / "o"), meta, {name: (1, 3)}, 2, 1, False)
    torch.save(torch.zeros(3), bad)
    with pytest.raises(AutoEPCheckpointError, match="Missing AutoEP fp32 fragments for m.experts.w1, EP rank 1"):
        consolidate_autoep_zero12_expert_states(temp, str(tmp_path / "o"), meta, {name: (1, 3)}, 2, 1, False)


def _bad_files(save_dir: str) -> dict:
    from deepspeed.checkpoint.ds_to_universal import main as convert

    engine = _engine(1, 2)
    _steps(engine, 0, 1)
    engine.save_checkpoint(save_dir, tag="t")
    convert(["--input_folder", os.path.join(save_dir, "t"), "--output_folder", os.path.join(save_dir, "u")])
    errors = {}
    expert = os.path.join(save_dir, "u", "zero", "model.layers.0.mlp.experts.w1", "fp32.pt")
    saved = torch.load(expert, weights_only=False)
    torch.save({**saved, "param": saved["param"][:3], "ep_num_experts": 3}, expert)  # one expert short
    try:
        _engine(1, 2, universal=True).load_checkpoint(save_dir, tag="u")
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        errors["universal"] = str(exc)
    os.remove(os.path.join(save_dir, "t", "layer_1_expert_2_mp_rank_00_model_states.pt"))
    try:
        _engine(1, 2).load_checkpoint(save_dir, tag="t")
    except Exception as exc:  # noqa: BLE001
        errors["plain"] = str(exc)
    return errors


def test_bad_expert_files_are_named_on_load(tmp_path):
    (errors,) = run_distributed(_bad_files, world_size=1, args=(str(tmp_path),), timeout=120)
    assert "model.layers.0.mlp.experts.w1" in errors["universal"] and "fp32.pt" in errors["universal"]
    assert "layer_1_expert_2_mp_rank_00_model_states.pt" in errors["plain"]
    assert "expected layout: per-expert files named by model-parallel rank 0" in errors["plain"]


def _other_expert_count(save_dir: str) -> tuple[str, str]:
    import deepspeed
    from deepspeed.checkpoint.ds_to_universal import main as convert

    engine = _engine(2, 2)
    _steps(engine, 0, 1)
    engine.save_checkpoint(save_dir, tag="t")
    if dist.get_rank() == 0:
        convert(["--input_folder", os.path.join(save_dir, "t"), "--output_folder", os.path.join(save_dir, "u")])
    dist.barrier()
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=24, num_local_experts=8,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2}, "checkpoint": {"load_universal": True},
           "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}}
    target, *_ = deepspeed.initialize(model=transformers.MixtralForCausalLM(config), config=cfg)
    try:
        target.load_checkpoint(save_dir, tag="u")
    except ValueError as exc:  # raised as a ValueError on every rank, as DeepSpeed's load does
        return type(exc).__name__, str(exc)
    return "", "loaded"


def test_universal_load_names_the_expert_count_before_any_other_shape(tmp_path):
    """Saved with 4 experts, loaded into 8 at autoep_size 2: the router's shape differs and the expert files are
    missing too, but the error says the expert layout is what differs (checked before anything else is read)."""
    for kind, error in run_distributed(_other_expert_count, world_size=2, args=(str(tmp_path),), timeout=240):
        assert kind == "CheckpointRankValueError", error
        assert "target_local_experts=4, checkpoint_local_experts=2" in error
        assert "router" not in error and "mp_rank_00_model_states.pt: saved AutoEP layers" in error


def _stage0(save_dir: str) -> tuple:
    engine = _engine(2, 0)
    _steps(engine, 0, BEFORE)
    engine.save_checkpoint(save_dir, tag="s0")
    reference = _steps(engine, BEFORE, AFTER)
    same = _engine(2, 0)
    same.load_checkpoint(save_dir, tag="s0")
    whole = _engine(1, 0)  # every expert on each rank: the weights from all per-expert files
    whole.load_checkpoint(save_dir, tag="s0", load_optimizer_states=False)
    w2 = whole.module.model.layers[1].mlp.experts.w2.detach()
    saved = torch.load(os.path.join(save_dir, "s0", "layer_1_expert_3_mp_rank_00_model_states.pt"))
    return reference, _steps(same, BEFORE, AFTER), torch.equal(w2[3], saved["model.layers.1.mlp.experts.w2.3"])


def test_stage0_resumes_at_the_same_size_and_loads_weights_at_another(tmp_path):
    for reference, resumed, expert_equal in run_distributed(_stage0, world_size=2, args=(str(tmp_path),),
                                                            timeout=200):
        assert resumed == reference and expert_equal
