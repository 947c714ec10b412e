"""Data efficiency: the curriculum-learning difficulty scheduler and random-LTD (schedule and layer wrapper).

Reference values (``tests/_data_efficiency_reference.py``) were recorded by running DeepSpeed 0.19.8's pure-python
schedulers on the configs below.
"""

from __future__ import annotations

import math

import pytest
import torch
from _data_efficiency_reference import (
    LTD_REFERENCE_SEQS,
    LTD_REFERENCE_STATE,
    LTD_REFERENCE_TOTAL_2100,
    REFERENCE,
    REFERENCE_STEPS,
)

from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from deepspeed.runtime.data_pipeline.data_routing.basic_layer import RandomLayerTokenDrop
from deepspeed.runtime.data_pipeline.data_routing.helper import (
    convert_to_random_ltd,
    random_ltd_initialize,
    remove_random_ltd_state_dict,
)
from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler
from ds_config._errors import ConfigError
from ds_config.data_efficiency import CurriculumLearningConfig

CONFIGS = {
    "discrete": {
        "max_difficulty": 3,
        "min_difficulty": 1,
        "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]},
        "schedule_type": "fixed_discrete",
    },
    "linear": {
        "max_difficulty": 1024,
        "min_difficulty": 8,
        "schedule_config": {"difficulty_step": 8, "total_curriculum_step": 1000},
        "schedule_type": "fixed_linear",
    },
    "linear_floor": {
        "max_difficulty": 100,
        "min_difficulty": 8,
        "schedule_config": {"difficulty_step": 16, "total_curriculum_step": 50},
        "schedule_type": "fixed_linear",
    },
    "root2": {
        "max_difficulty": 2048,
        "min_difficulty": 64,
        "schedule_config": {"difficulty_step": 8, "root_degree": 2, "total_curriculum_step": 777},
        "schedule_type": "fixed_root",
    },
    "root3": {
        "max_difficulty": 512,
        "min_difficulty": 2,
        "schedule_config": {"difficulty_step": 16, "root_degree": 3, "total_curriculum_step": 300},
        "schedule_type": "fixed_root",
    },
}

LTD_CONFIG = {
    "global_batch_size": 32,
    "layer_token_lr_schedule": {"enabled": False},
    "random_ltd_layer_num": 22,
    "random_ltd_schedule": {
        "max_value": 2048,
        "min_value": 128,
        "schedule_config": {"require_steps": 2000, "seq_per_step": 16},
        "schedule_type": "fixed_linear",
    },
    "total_layer_num": 24,
}


def _formula(config: dict, step: int) -> int:
    """DeepSpeed's fixed_linear / fixed_root formula, written out independently of the implementation."""
    lo, hi = config["min_difficulty"], config["max_difficulty"]
    sc = config["schedule_config"]
    degree = sc.get("root_degree", 1) if config["schedule_type"] == "fixed_root" else 1
    value = math.floor((step / sc["total_curriculum_step"]) ** (1.0 / degree) * (hi - lo) + lo)
    value -= value % sc["difficulty_step"]
    value = max(value, math.ceil(lo / sc["difficulty_step"]) * sc["difficulty_step"])
    return min(value, hi)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_schedules_reproduce_deepspeed_reference_values(name):
    sched = CurriculumScheduler(CONFIGS[name])
    assert [sched.get_difficulty(t) for t in REFERENCE_STEPS] == REFERENCE[name]["get"]
    fresh = CurriculumScheduler(CONFIGS[name])
    assert [fresh.update_difficulty(t) for t in range(0, 1200, 37)] == REFERENCE[name]["update_every_37"]


@pytest.mark.parametrize("name", ["linear", "linear_floor", "root2", "root3"])
def test_root_schedules_follow_the_formula_at_every_step(name):
    config = CONFIGS[name]
    sched = CurriculumScheduler(config)
    step_size = config["schedule_config"]["difficulty_step"]
    for t in range(0, 2 * config["schedule_config"]["total_curriculum_step"] + 3):
        value = sched.get_difficulty(t)
        assert value == _formula(config, t), t
        assert value == config["max_difficulty"] or value % step_size == 0


def test_fixed_discrete_boundaries_are_inclusive():
    sched = CurriculumScheduler(CONFIGS["discrete"])
    assert [sched.get_difficulty(t) for t in (0, 5, 6, 10, 11, 10**6)] == [1, 1, 2, 2, 3, 3]


def test_update_stops_at_max_and_current_difficulty_is_settable():
    sched = CurriculumScheduler(CONFIGS["linear"])
    assert sched.get_current_difficulty() == 8
    assert sched.update_difficulty(2000) == 1024
    assert sched.update_difficulty(10) == 1024  # once at max it stays there, as in DeepSpeed
    sched.set_current_difficulty(64)
    assert sched.get_current_difficulty() == 64
    assert sched.update_difficulty(500) == 512


def test_custom_schedule():
    config = {"min_difficulty": 4, "max_difficulty": 64, "schedule_type": "custom"}
    sched = CurriculumScheduler(config)
    with pytest.raises(RuntimeError, match="set_custom_get_difficulty"):
        sched.update_difficulty(1)
    sched.set_custom_get_difficulty(lambda step: min(64, 4 * 2 ** (step // 10)))
    assert [sched.update_difficulty(t) for t in (0, 10, 25, 39, 100, 0)] == [4, 8, 16, 32, 64, 64]


def test_typed_legacy_section_is_accepted():
    typed = CurriculumLearningConfig(
        enabled=True,
        curriculum_type="seqlen",
        min_difficulty=8,
        max_difficulty=1024,
        schedule_type="fixed_linear",
        schedule_config={"total_curriculum_step": 1000, "difficulty_step": 8},
    )
    sched = CurriculumScheduler(typed)
    assert [sched.get_difficulty(t) for t in REFERENCE_STEPS] == REFERENCE["linear"]["get"]


def test_state_dict_round_trip():
    sched = CurriculumScheduler(CONFIGS["root2"])
    sched.update_difficulty(300)
    saved = sched.state_dict()
    sched.update_difficulty(700)
    other = CurriculumScheduler(CONFIGS["root2"])
    other.load_state_dict(saved)
    assert other.get_current_difficulty() == saved["current_difficulty"] == REFERENCE["root2"]["get"][17]
    assert other.update_difficulty(700) == sched.get_current_difficulty()
    saved["schedule_config"]["root_degree"] = 5  # a copy: mutating it leaves the scheduler alone
    assert other.state["schedule_config"]["root_degree"] == 2


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda c: c.pop("min_difficulty"), "curriculum_learning.min_difficulty"),
        (lambda c: c.pop("schedule_type"), "curriculum_learning.schedule_type"),
        (lambda c: c.update(schedule_type="fixed_cubic"), "curriculum_learning.schedule_type"),
        (lambda c: c["schedule_config"].pop("difficulty_step"), "curriculum_learning.schedule_config.difficulty_step"),
        (lambda c: c.update(schedule_type="fixed_root"), "curriculum_learning.schedule_config.root_degree"),
        (lambda c: c.update(schedule_type="fixed_discrete"), "curriculum_learning.schedule_config.difficulty"),
    ],
)
def test_bad_config_names_the_key(mutate, key):
    config = {**CONFIGS["linear"], "schedule_config": dict(CONFIGS["linear"]["schedule_config"])}
    mutate(config)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        CurriculumScheduler(config)


def test_fixed_discrete_list_lengths_are_checked():
    config = {**CONFIGS["discrete"], "schedule_config": {"difficulty": [1, 2], "max_step": [5, 10]}}
    with pytest.raises(ConfigError, match="max_step"):
        CurriculumScheduler(config)


# --- random-LTD schedule -----------------------------------------------------------------------------------------
def test_random_ltd_schedule_reproduces_deepspeed():
    sched = RandomLTDScheduler(LTD_CONFIG)
    seqs = []
    for t in range(0, 2500, 61):
        sched.update_seq(t)
        seqs.append(sched.get_current_seq())
    sched.update_seq(2439)  # the same step again is not counted twice
    assert seqs == LTD_REFERENCE_SEQS
    assert sched.state_dict() == LTD_REFERENCE_STATE
    assert RandomLTDScheduler(LTD_CONFIG).get_total_layer_tokens(2100) == LTD_REFERENCE_TOTAL_2100


def test_random_ltd_schedule_formula_and_state_dict():
    sched = RandomLTDScheduler(LTD_CONFIG)
    sc = LTD_CONFIG["random_ltd_schedule"]
    lo, hi = sc["min_value"], sc["max_value"]
    req, per = sc["schedule_config"]["require_steps"], sc["schedule_config"]["seq_per_step"]
    for t in range(0, 2200, 7):
        expected = math.floor(t / req * (hi - lo) + lo)
        assert sched.get_value(t) == min(expected - expected % per, hi)
    sched.update_seq(500)
    saved = sched.state_dict()
    other = RandomLTDScheduler(LTD_CONFIG)
    other.load_state_dict(saved)
    assert other.get_current_seq() == sched.get_current_seq() == 608
    assert other.state_dict() == saved


def test_random_ltd_missing_key_is_named():
    config = {**LTD_CONFIG, "random_ltd_schedule": {"min_value": 8, "max_value": 64, "schedule_config": {}}}
    with pytest.raises(ConfigError, match=r"random_ltd_schedule\.schedule_config\.require_steps"):
        RandomLTDScheduler(config)
    with pytest.raises(ConfigError, match="global_batch_size"):
        RandomLTDScheduler({k: v for k, v in LTD_CONFIG.items() if k != "global_batch_size"})


# --- RandomLayerTokenDrop ----------------------------------------------------------------------------------------
class _Recorder(torch.nn.Module):
    """A per-token layer that remembers what it was given (and the mask kwarg)."""

    def __init__(self, hidden: int, tuple_out: bool = False) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)
        self.tuple_out = tuple_out
        self.seen: list[torch.Tensor] = []
        self.masks: list = []

    def forward(self, x, attention_mask=None):
        self.seen.append(x.detach().clone())
        self.masks.append(attention_mask)
        y = torch.tanh(self.linear(x))
        return (y, "extra") if self.tuple_out else y


def _ltd(
    min_value: int, max_value: int, order: str = "batch_seq_dim", model_type: str = "decoder", layers: int = 1
) -> dict:
    return {
        "total_layer_num": layers,
        "random_ltd_layer_num": layers,
        "random_ltd_layer_id": list(range(layers)),
        "model_mask_name": "attention_mask",
        "model_type": model_type,
        "hidden_state_order": order,
        "global_batch_size": 4,
        "micro_batch_size": 4,
        "random_ltd_schedule": {
            "min_value": min_value,
            "max_value": max_value,
            "schedule_type": "fixed_linear",
            "schedule_config": {"require_steps": 100, "seq_per_step": 4},
        },
    }


def _wrapped(config: dict, **layer_kw):
    scheduler = RandomLTDScheduler(config)
    layer = RandomLayerTokenDrop(_Recorder(8, **layer_kw))
    layer.init_config(config, scheduler, 0)
    return layer, scheduler


def _kept_positions(x: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """For each sample (batch-first), the sequence positions whose rows appear in ``seen``."""
    matches = (x.unsqueeze(2) == seen.unsqueeze(1)).all(-1)  # [B, S, kept]
    assert (matches.sum(1) == 1).all(), "every kept row comes from exactly one position"
    return matches.float().argmax(1)


@pytest.mark.parametrize("order", ["batch_seq_dim", "seq_batch_dim"])
def test_layer_keeps_the_scheduled_tokens_and_passes_the_rest_through(order):
    torch.manual_seed(0)
    config = _ltd(12, 32, order)
    layer, scheduler = _wrapped(config)
    x = torch.randn(4, 32, 8)
    mask = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32).expand(4, 1, 32, 32)
    for step, kept in ((0, 12), (50, 20), (99, 28)):
        scheduler.update_seq(step)
        assert scheduler.get_current_seq() == kept
        inp = x if order == "batch_seq_dim" else x.transpose(0, 1)
        out = layer(inp, attention_mask=mask)
        out_b = out if order == "batch_seq_dim" else out.transpose(0, 1)
        seen = layer.random_ltd_layer.seen[-1]
        seen_b = seen if order == "batch_seq_dim" else seen.transpose(0, 1)
        assert seen_b.shape == (4, kept, 8)
        positions = _kept_positions(x, seen_b)
        assert (positions[:, 1:] > positions[:, :-1]).all(), "kept tokens stay in sequence order"
        dropped = torch.ones(4, 32, dtype=torch.bool)
        dropped[torch.arange(4).unsqueeze(1), positions] = False
        assert (dropped.sum(1) == 32 - kept).all()
        assert torch.equal(out_b[dropped], x[dropped])
        expected = torch.tanh(layer.random_ltd_layer.linear(x))
        assert torch.allclose(out_b[~dropped], expected[~dropped], atol=1e-6)
        assert layer.random_ltd_layer.masks[-1].shape == (4, 1, kept, kept)  # decoder: the causal mask, cut


def test_samples_draw_different_tokens_and_encoder_masks_follow_them():
    torch.manual_seed(1)
    config = _ltd(16, 64, model_type="encoder")
    layer, _ = _wrapped(config)
    x = torch.randn(4, 64, 8)
    mask = torch.randn(4, 1, 64, 64)
    layer(x, attention_mask=mask)
    positions = _kept_positions(x, layer.random_ltd_layer.seen[-1])
    assert len({tuple(p.tolist()) for p in positions}) > 1
    part = layer.random_ltd_layer.masks[-1]
    for b in range(4):
        assert torch.equal(part[b, 0], mask[b, 0][positions[b]][:, positions[b]])


def test_eval_mode_and_full_length_equal_the_wrapped_layer():
    torch.manual_seed(2)
    layer, scheduler = _wrapped(_ltd(8, 16), tuple_out=True)
    x = torch.randn(2, 16, 8)
    mask = torch.ones(2, 1, 16, 16)
    layer.eval()
    out, extra = layer(x, attention_mask=mask)
    assert extra == "extra" and torch.equal(out, layer.random_ltd_layer(x, attention_mask=mask)[0])
    assert layer.random_ltd_layer.seen[-2].shape == (2, 16, 8)
    layer.train()
    scheduler.update_seq(1000)  # kept == max == seq length: nothing is dropped
    assert torch.equal(layer(x, attention_mask=mask)[0], layer.random_ltd_layer(x, attention_mask=mask)[0])
    scheduler.set_current_seq(8)
    out, extra = layer(x, attention_mask=mask)
    assert extra == "extra" and layer.random_ltd_layer.seen[-1].shape == (2, 8, 8)


def test_gradients_flow_through_kept_and_dropped_tokens():
    torch.manual_seed(3)
    layer, _ = _wrapped(_ltd(4, 16))
    x = torch.randn(2, 16, 8, requires_grad=True)
    layer(x, attention_mask=torch.ones(2, 1, 16, 16)).sum().backward()
    positions = _kept_positions(x.detach(), layer.random_ltd_layer.seen[-1])
    dropped = torch.ones(2, 16, dtype=torch.bool)
    dropped[torch.arange(2).unsqueeze(1), positions] = False
    assert torch.equal(x.grad[dropped], torch.ones_like(x.grad[dropped]))  # identity for dropped tokens
    assert not torch.allclose(x.grad[~dropped], torch.ones_like(x.grad[~dropped]))
    assert layer.random_ltd_layer.linear.weight.grad is not None


def test_convert_and_initialize_share_indices_across_layers():
    torch.manual_seed(4)
    model = torch.nn.Sequential(_Recorder(8), _Recorder(8), torch.nn.Linear(8, 8))
    convert_to_random_ltd(model, _Recorder)
    assert [type(m).__name__ for m in model] == ["RandomLayerTokenDrop", "RandomLayerTokenDrop", "Linear"]
    config = {**_ltd(6, 16, layers=2), "total_layer_num": 3}
    scheduler = RandomLTDScheduler(config)
    assert random_ltd_initialize(model, config, scheduler) == 2
    x = torch.randn(2, 16, 8)
    h = model[1](model[0](x, attention_mask=None), attention_mask=None)
    assert scheduler.state["sample_idx"].shape == (2, 2, 6)
    assert model[0].random_ltd_layer.seen[-1].shape == model[1].random_ltd_layer.seen[-1].shape == (2, 6, 8)
    assert h.shape == x.shape
    keys = remove_random_ltd_state_dict(model.state_dict()).keys()
    assert set(keys) == set(torch.nn.Sequential(_Recorder(8), _Recorder(8), torch.nn.Linear(8, 8)).state_dict())
    with pytest.raises(ValueError, match="random_ltd_layer_num"):
        random_ltd_initialize(model, {**config, "random_ltd_layer_num": 3, "random_ltd_layer_id": [0, 1, 2]}, scheduler)


def test_data_sampling_module_paths_import():
    import importlib

    for name, attr in (("data_sampler", "DeepSpeedDataSampler"), ("data_analyzer", "DataAnalyzer"),
                       ("indexed_dataset", "MMapIndexedDataset"), ("utils", "find_fit_int_dtype")):
        module = importlib.import_module(f"deepspeed.runtime.data_pipeline.data_sampling.{name}")
        assert callable(getattr(module, attr))


class _SeqlenEcho(torch.nn.Module):
    """Records the ``curriculum_seqlen`` the engine passes and trains on that prefix of the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.seen: list[int | None] = []

    def forward(self, x: torch.Tensor, curriculum_seqlen: int | None = None) -> torch.Tensor:
        self.seen.append(curriculum_seqlen)
        return self.lin(x[:, :curriculum_seqlen]).mean()


def _curriculum_through_engine() -> list:
    import deepspeed

    cfg = {"train_batch_size": 2, "steps_per_print": 10**6, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8,
                                   "max_difficulty": 64, "schedule_type": "fixed_linear",
                                   "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8}}}
    engine, *_ = deepspeed.initialize(model=_SeqlenEcho(), config=cfg)
    for _ in range(6):
        engine.backward(engine(torch.randn(2, 64, 4)))
        engine.step()
    engine.eval()
    engine(torch.randn(2, 64, 4))  # evaluation: no curriculum
    return engine.module.seen


def test_engine_passes_curriculum_seqlen():
    from _harness import run_distributed

    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

    seen = run_distributed(_curriculum_through_engine, world_size=1, timeout=60)[0]
    reference = CurriculumScheduler({"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8,
                                     "max_difficulty": 64, "schedule_type": "fixed_linear",
                                     "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8}})
    assert seen[:6] == [reference.get_difficulty(step) for step in range(1, 7)] and seen[-1] is None
    assert seen[0] < seen[3] <= 64 and seen[5] == 64


def test_random_ltd_bad_settings_name_the_key_and_what_is_accepted():
    layer = RandomLayerTokenDrop(torch.nn.Linear(4, 4))
    sched = RandomLTDScheduler(_ltd(2, 8))
    with pytest.raises(ValueError, match=r"hidden_state_order='sideways': accepted: batch_seq_dim, seq_batch_dim"):
        layer.init_config(_ltd(2, 8, order="sideways"), sched, 0)
    with pytest.raises(ValueError, match=r"model_type='vision': accepted: encoder, decoder"):
        layer.init_config(_ltd(2, 8, model_type="vision"), sched, 0)
    with pytest.raises(ValueError, match=r"layer_token_lr_schedule.enabled=True.*accepted: false"):
        RandomLTDScheduler({**LTD_CONFIG, "layer_token_lr_schedule": {"enabled": True}})


class _Block(torch.nn.Linear):
    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x)


class _LtdModel(torch.nn.Module):
    """Two layers, layer 0 under random-LTD; takes the legacy ``curriculum_seqlen`` and records it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([_Block(4, 4), torch.nn.Linear(4, 4)])
        self.seen: list[int | None] = []

    def forward(self, x: torch.Tensor, curriculum_seqlen: int | None = None) -> torch.Tensor:
        self.seen.append(curriculum_seqlen)
        x = x[:, :curriculum_seqlen]
        return self.layers[1](self.layers[0](x, attention_mask=None)).pow(2).mean()


LEGACY_AND_LTD = {
    "train_batch_size": 2, "steps_per_print": 10**6, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 32,
                            "schedule_type": "fixed_linear",
                            "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 8}},
    "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
        "enabled": True, "total_layer_num": 2, "random_ltd_layer_num": 1, "random_ltd_layer_id": [0],
        "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {"min_value": 8, "max_value": 32,
                                "schedule_config": {"require_steps": 8, "seq_per_step": 8}}}}}}


def _legacy_and_ltd_resume(ckpt: str) -> tuple[list, list]:
    import deepspeed

    data = torch.randn(12, 2, 32, 4, generator=torch.Generator().manual_seed(1))

    def build():
        engine, *_ = deepspeed.initialize(model=convert_to_random_ltd(_LtdModel(), _Block), config=LEGACY_AND_LTD)
        engine.random_ltd_initialize()
        return engine

    def run(engine, steps):
        out = []
        for _ in range(steps):
            torch.manual_seed(engine.global_steps)  # the token draw is random: same seed per step in both runs
            loss = engine(data[engine.global_steps])
            engine.backward(loss)
            engine.step()
            out.append((engine.module.seen[-1], loss.item(), dict(engine.random_ltd_scheduler.state_dict())))
        return out

    engine = build()
    run(engine, 3)
    engine.save_checkpoint(ckpt)
    expected = run(engine, 4)
    resumed = build()
    resumed.load_checkpoint(ckpt)
    return expected, run(resumed, 4)


def test_legacy_curriculum_and_random_ltd_resume_from_a_checkpoint(tmp_path):
    from _harness import run_distributed

    expected, got = run_distributed(_legacy_and_ltd_resume, world_size=1, args=(str(tmp_path),), timeout=60)[0]
    assert got == expected  # same seqlen, loss, kept tokens and consumed layer-tokens after the restore
    def multiple_of_8(value: float) -> int:
        return min(32, math.floor(value) // 8 * 8)
    assert [seqlen for seqlen, _, _ in expected] == [multiple_of_8(t / 6 * 24 + 8) for t in (4, 5, 6, 7)]
    assert [s["current_value"] for _, _, s in expected] == [multiple_of_8(t / 8 * 24 + 8) for t in (3, 4, 5, 6)]
    tokens = [s["consumed_layer_tokens"] for _, _, s in expected]
    assert tokens[1] - tokens[0] == 2 * (multiple_of_8(4 / 8 * 24 + 8) + 32)  # batch * (kept + full layer)
