"""AutoTP training (spec 2.1.9): ``tensor_parallel.autotp_size: 2`` shards a tiny Llama at ``deepspeed.initialize``
and trains to the one-rank losses and gradient norms with ZeRO 0/1/2, by the HF tp_plan, the heuristics, a preset
and a custom ``partition_config``; the stage-3 and unsupported-plan errors; checkpoints with full weights."""

from __future__ import annotations

import pytest
import torch
from _autotp_models import tiny, without_tp_plan
from _harness import run_distributed

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "gradient_clipping": 0.5}
STEPS = 3


def _llama(plan: bool) -> torch.nn.Module:
    model = tiny("llama").train()
    if not plan:  # no Hugging Face tp_plan: the config's, the instance's and the class's
        without_tp_plan(model)
    return model


def _train(tp_section: dict | None, stage: int, plan: bool = True) -> dict:
    import deepspeed
    from deepspeed.utils import groups

    model = _llama(plan)
    config = {**BASE, "zero_optimization": {"stage": stage}}
    if tp_section is not None:
        config["tensor_parallel"] = tp_section
    engine, *_ = deepspeed.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(5)
    losses, norms = [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, 96, (2, 8), generator=generator)
        loss = engine(input_ids=tokens, labels=tokens, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    layer = engine.module.model.layers[0]
    return {"losses": losses, "norms": norms,
            "classes": [type(m).__name__ for m in (layer.self_attn.q_proj, layer.mlp.down_proj,
                                                  engine.module.model.embed_tokens)],
            "groups": (groups.get_tensor_model_parallel_world_size(), groups.get_data_parallel_world_size())}


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(_train, world_size=1, args=(None, 0), timeout=120)[0]


def _matches(results: list[dict], reference: dict) -> None:
    for result in results:
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert result["norms"] == pytest.approx(reference["norms"], abs=1e-5)
        assert result["groups"] == (2, 1)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_autotp_2_trains_like_one_rank_with_zero(stage, reference):
    results = run_distributed(_train, world_size=2, args=({"autotp_size": 2}, stage), timeout=120)
    _matches(results, reference)
    # the model's base_model_tp_plan (colwise/rowwise) decides: projections sharded, embedding replicated
    assert results[0]["classes"] == ["LinearLayer", "LinearAllreduce", "Embedding"]


def test_heuristics_and_preset_without_a_hf_plan(reference):
    heuristic = run_distributed(_train, world_size=2, args=({"autotp_size": 2}, 1, False), timeout=120)
    _matches(heuristic, reference)
    assert heuristic[0]["classes"] == ["LinearLayer", "LinearAllreduce", "HiddenParallelEmbedding"]
    preset = run_distributed(_train, world_size=2, args=({"autotp_size": 2, "preset_model": "llama"}, 0, False),
                             timeout=120)
    _matches(preset, reference)
    assert preset[0]["classes"] == ["LinearLayer", "LinearAllreduce", "Embedding"]


def test_partition_config_has_the_highest_priority(reference):
    section = {"autotp_size": 2, "partition_config": {"layer_specs": [
        {"patterns": [r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.mlp\.(gate|up)_proj\.weight$"], "partition_type": "column"}]}}
    results = run_distributed(_train, world_size=2, args=(section, 2), timeout=120)
    _matches(results, reference)
    assert results[0]["classes"] == ["Linear", "LinearAllreduce", "Embedding"]  # attention left whole


def _errors() -> list[str]:
    import deepspeed
    from deepspeed.runtime import autotp as _autotp_setup
    from ds_config import ConfigError

    messages = []
    with pytest.raises(ConfigError) as stage3:
        deepspeed.initialize(model=_llama(True), config={**BASE, "zero_optimization": {"stage": 3},
                                                         "tensor_parallel": {"autotp_size": 2}})
    messages.append(str(stage3.value))
    model = _llama(True)
    model.config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "local_colwise"}  # a style not built
    with pytest.raises(ConfigError) as plan:
        deepspeed.initialize(model=model, config={**BASE, "tensor_parallel": {"autotp_size": 2}})
    messages.append(str(plan.value))
    deepspeed.tp_model_init(_llama(True), tp_size=4, dtype=torch.float32)
    with pytest.raises(ConfigError) as conflict:
        deepspeed.initialize(model=_llama(True), config={**BASE, "tensor_parallel": {"autotp_size": 2}})
    messages.append(str(conflict.value))
    assert not _autotp_setup._RECORDED  # consumed by the failed initialize: a corrected retry starts clean
    deepspeed.tp_model_init(_llama(True), tp_size=2, dtype=torch.bfloat16)  # the config trains in fp16
    with pytest.raises(ConfigError) as dtype:
        deepspeed.initialize(model=_llama(True), config={**BASE, "fp16": {"enabled": True},
                                                         "tensor_parallel": {"autotp_size": 2}})
    messages.append(str(dtype.value))
    assert not _autotp_setup._RECORDED
    return messages


def test_unsupported_combinations_are_clear_errors():
    stage3, plan, conflict, dtype = run_distributed(_errors, world_size=2, timeout=120)[0]
    assert "gradient_clipping" in stage3 and "tensor-parallel group" in stage3  # BASE clips; ZeRO-3 cannot yet
    assert "local_colwise" in plan
    assert "tp_model_init" in conflict and "autotp_size" in conflict
    assert "Conflicting dtype" in dtype and "bfloat16" in dtype and "fp16" in dtype


def _checkpoint(save_dir: str) -> bool:
    import torch.distributed as dist

    import deepspeed
    from ds_inference.autotp import full_state_dict

    deepspeed.set_autotp_mode(training=True)
    deepspeed.tp_model_init(_llama(False), tp_size=2, dtype=torch.float32)  # the old path, merged with the config
    engine, *_ = deepspeed.initialize(model=_llama(False), config={**BASE, "tensor_parallel": {"autotp_size": 2}})
    tokens = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))
    engine.backward(engine(input_ids=tokens, labels=tokens, use_cache=False).loss)
    engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    full = full_state_dict(engine.module)
    saved = torch.load(f"{save_dir}/t/mp_rank_00_model_states.pt", weights_only=False)
    plain = tiny("llama")
    plain.load_state_dict(saved["module"])  # full weights: they load into the model without TP
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in full.items())
    engine.save_16bit_model(save_dir)  # gathered too (written by rank 0)
    dist.barrier()
    sixteen = torch.load(f"{save_dir}/pytorch_model.bin", weights_only=True)
    assert all(torch.equal(sixteen[k], v) for k, v in full.items())
    fresh, *_ = deepspeed.initialize(model=_llama(False), config={**BASE, "tensor_parallel": {"autotp_size": 2}})
    fresh.load_checkpoint(save_dir, tag="t")
    for (name, a), b in zip(engine.module.state_dict().items(), fresh.module.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    return dist.get_rank() == 0 and saved["autotp_size"] == 2


def test_checkpoint_holds_full_weights_and_round_trips(tmp_path):
    assert run_distributed(_checkpoint, world_size=2, args=(str(tmp_path),), timeout=120)[0]


def _data_and_tensor_parallel(tp: int, micro_batch: int) -> dict:
    """Two steps on a batch of 4 sequences, each data-parallel rank taking its ``micro_batch`` of them."""
    import torch.distributed as dist

    import deepspeed
    from ds_inference.autotp import full_state_dict

    config = {**BASE, "train_micro_batch_size_per_gpu": micro_batch, "zero_optimization": {"stage": 1}}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    engine, *_ = deepspeed.initialize(model=_llama(True), config=config)
    dp_rank = dist.get_rank() // tp
    generator = torch.Generator().manual_seed(9)
    for _ in range(2):
        tokens = torch.randint(0, 96, (4, 8), generator=generator)[dp_rank * micro_batch:(dp_rank + 1) * micro_batch]
        engine.backward(engine(input_ids=tokens, labels=tokens, use_cache=False).loss)
        engine.step()
    return {k: v.clone() for k, v in (full_state_dict(engine.module) if tp > 1 else engine.module.state_dict()).items()}


@pytest.mark.slow
def test_four_ranks_tensor_and_data_parallel_train_like_one_rank():
    want = run_distributed(_data_and_tensor_parallel, world_size=1, args=(1, 4), timeout=120)[0]
    results = run_distributed(_data_and_tensor_parallel, world_size=4, args=(2, 2), timeout=180)
    # 5e-5: the split layers (the class plan's gathered lm_head too) sum in another order, and Adam (lr 1e-2) turns
    # 1e-7 differences of near-zero gradients into ~1e-5 of the weights (measured up to 1.5e-5; one step is 1e-2)
    for got in results:
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=5e-5, msg=name)


def test_data_groups_follow_the_given_tensor_groups():
    from deepspeed.runtime.autotp import data_parallel_ranks

    assert data_parallel_ranks([[0, 1], [2, 3]], 4) == [[0, 2], [1, 3]]
    assert data_parallel_ranks([[0, 2], [1, 3]], 4) == [[0, 1], [2, 3]]  # strided tensor groups
    with pytest.raises(ValueError, match="disjoint groups of one size"):
        data_parallel_ranks([[0, 1], [1, 2]], 4)


def _strided_tp_group() -> tuple:
    """tp_model_init's tp_group holding ranks {0, 2} / {1, 3}: the data groups are {0, 1} / {2, 3}."""
    import torch.distributed as dist

    from deepspeed.runtime.autotp import _GroupMpu

    tensor = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mpu = _GroupMpu(tensor[dist.get_rank() % 2])
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total, group=mpu.get_data_parallel_group())
    return (mpu.get_tensor_model_parallel_rank(), mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
            total.item())


def test_a_strided_tp_group_gets_the_matching_data_groups():
    results = run_distributed(_strided_tp_group, world_size=4, timeout=120)
    # (tensor rank, data rank, data world, sum of the data group's global ranks); before the fix the data group
    # of a strided tensor group was the tensor group itself
    assert results == [(0, 0, 2, 1.0), (0, 1, 2, 1.0), (1, 0, 2, 5.0), (1, 1, 2, 5.0)]


def test_rule_priority_and_use_default_specs():
    from deepspeed.runtime.autotp import layer_specs
    from ds_config.parallel import TensorParallelConfig

    def patterns(section: dict, plan: bool) -> list[str] | None:
        specs = layer_specs(_llama(plan), TensorParallelConfig.model_validate({"autotp_size": 2, **section}))
        return None if specs is None else [p for s in specs for p in s.patterns]

    custom = {"layer_specs": [{"patterns": ["a"], "partition_type": "row"}]}
    preset = [r".*\.self_attn\.o_proj\.weight$", r".*\.self_attn\.[qkv]_proj\.weight$",
              r".*\.mlp\.down_proj\.weight$", r".*\.mlp\.(up|gate)_proj\.weight$"]
    # partition_config first; use_default_specs appends the preset_model specs, and only when one is given
    assert patterns({"preset_model": "llama", "partition_config": {**custom, "use_default_specs": True}},
                    True) == ["a", *preset]
    assert patterns({"preset_model": "llama", "partition_config": custom}, True) == ["a"]
    assert patterns({"partition_config": {**custom, "use_default_specs": True}}, False) == ["a"]
    # then the Hugging Face plan (over preset_model), then the preset, else the heuristics (None)
    hf = patterns({"preset_model": "llama"}, True)
    assert hf != preset and any("q_proj" in p for p in hf)
    assert patterns({"preset_model": "llama"}, False) == preset
    assert patterns({}, False) is None
