"""Elastic training batch arithmetic (``deepspeed.elasticity``): DeepSpeed's v0.1/v0.2 algorithms.

Expected values were recorded from the last upstream DeepSpeed elasticity code (DeepSpeed 0.19.8 itself removed
the feature, so it cannot be run for them).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_config import BatchSizes, ConfigError, ElasticityConfig, load_config
from ds_config.elastic import HIGHLY_COMPOSITE, compute_elastic_config, elastic_batch_sizes, elastic_plan
from ds_config.elasticity import ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize

BASE = {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32,
        "max_gpus": 1500, "min_time": 20, "version": 0.1}
A_VALID = [32, 34, 36, 48, 51, 64, 68, 72, 96, 102, 136, 144, 153, 192, 204, 272, 288, 306, 408, 576, 612, 816, 1224]
C_VALID = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15, 20, 21, 24, 28, 30, 35, 40, 42, 56, 60, 70, 84, 105, 120, 140,
           168, 210, 280, 420, 840]


def _ds(section: dict) -> dict:
    return {"elasticity": {"enabled": True, **section}}


def test_highly_composite_table():
    limit, counts = 30000, [0] * 30001
    for d in range(1, limit + 1):
        for multiple in range(d, limit + 1, d):
            counts[multiple] += 1
    record, expected = 0, []
    for n in range(1, limit + 1):
        if counts[n] > record:
            record, expected = counts[n], [*expected, n]
    assert [h for h in HIGHLY_COMPOSITE if h <= limit] == expected


def test_v01_reference_case():
    assert compute_elastic_config({"elasticity": BASE}, "0.19.8") == (9792, A_VALID)
    assert compute_elastic_config({"elasticity": BASE}, "0.19.8", world_size=64) == (9792, A_VALID, 17)
    assert compute_elastic_config({"elasticity": BASE}, "0.19.8", world_size=64, return_microbatch=True)[2] == 17


@pytest.mark.parametrize(("section", "world", "expected"), [
    ({"max_train_batch_size": 32, "micro_batch_sizes": [1, 2, 3, 7], "version": 0.1}, 3,
     (24, [1, 2, 3, 4, 6, 8, 12, 24], 2)),
    ({"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1}, 8, (1680, C_VALID, 6)),
    ({"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}, 8, (1680, C_VALID, 6)),  # v0.2 default
    ({"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}, 9, (1998, [9], 6)),  # v0.2: off the list
    ({"max_train_batch_size": 100, "micro_batch_sizes": [2, 4]}, 2, (96, [1, 2, 3, 4, 6, 8, 12, 16, 24, 48], 4)),
    ({**BASE, "version": 0.2, "num_gpus_per_node": 8}, 64, (7680, None, 12)),
    ({**BASE, "version": 0.2, "num_gpus_per_node": 8}, 100, (9600, [100], 16)),
])
def test_recorded_values(section, world, expected):
    batch, valid, micro = compute_elastic_config(_ds(section), "0.19.8", world_size=world)
    assert batch == expected[0] and micro == expected[2]
    if expected[1] is not None:
        assert valid == expected[1]
    assert world in valid and isinstance(batch, int)


def test_v02_model_parallel_counts_data_parallel_ranks():
    section = {**BASE, "version": 0.2, "num_gpus_per_node": 8, "model_parallel_size": 4}
    cfg = ElasticityConfig(_ds(section)["elasticity"])
    plan = elastic_plan(cfg, 16)  # 16 data-parallel ranks = 64 GPUs
    assert plan.train_batch_size == 8640 and len(plan.valid_world_sizes) == 24 and 16 in plan.valid_world_sizes
    assert elastic_batch_sizes(cfg, 16) == BatchSizes(8640, 12, 45, 16)
    with pytest.raises(ElasticityError, match="divisible by model parallel size"):
        compute_elastic_config(_ds({**section, "model_parallel_size": 3}), "0.19.8", world_size=8)


def test_prefer_larger_batch_breaks_ties():
    larger = compute_elastic_config(_ds({"max_train_batch_size": 100, "micro_batch_sizes": [3, 5], "version": 0.1}),
                                    "0.19.8")
    smaller = compute_elastic_config(_ds({"max_train_batch_size": 100, "micro_batch_sizes": [3, 5], "version": 0.1,
                                          "prefer_larger_batch": False}), "0.19.8")
    assert larger[0] >= smaller[0]


def test_errors():
    with pytest.raises(ElasticityIncompatibleWorldSize, match="World size \\(33\\)"):
        compute_elastic_config({"elasticity": BASE}, "0.19.8", world_size=33)
    with pytest.raises(ElasticityConfigError, match="missing"):
        compute_elastic_config({}, "0.19.8")
    with pytest.raises(ElasticityConfigError, match="disabled"):
        compute_elastic_config({"elasticity": {**BASE, "enabled": False}}, "0.19.8")
    with pytest.raises(ElasticityConfigError, match="missing max_train_batch_size"):
        compute_elastic_config(_ds({"micro_batch_sizes": [2]}), "0.19.8")
    with pytest.raises(ElasticityConfigError, match="only supports up to 0.2"):
        compute_elastic_config(_ds({**BASE, "version": 0.3}), "0.19.8")
    with pytest.raises(ElasticityConfigError, match="model-parallel"):
        compute_elastic_config(_ds({**BASE, "model_parallel_size": 2}), "0.19.8")
    with pytest.raises(ElasticityError, match="minimum version 0.3.8"):
        compute_elastic_config({"elasticity": BASE}, "0.3.7")
    with pytest.raises(ElasticityError, match="minimum version"):
        compute_elastic_config({"elasticity": BASE}, "0.3.8rc1")
    assert compute_elastic_config({"elasticity": BASE}, "0.3.8")[0] == 9792
    with pytest.raises(ValueError, match="dictionary"):
        compute_elastic_config("{}", "0.19.8")
    with pytest.raises(ElasticityConfigError, match="micro_batch_sizes"):
        compute_elastic_config(_ds({"max_train_batch_size": 10, "micro_batch_sizes": [0]}), "0.19.8")
    assert issubclass(ElasticityIncompatibleWorldSize, ConfigError)


def test_v02_needs_a_world_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ElasticityConfigError, match="WORLD_SIZE"):
        compute_elastic_config(_ds({"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}), "0.19.8")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert compute_elastic_config(_ds({"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}), "0.19.8",
                                  return_microbatch=True) == (1680, C_VALID, 6)


def test_resolves_through_the_config():
    cfg = load_config({"elasticity": {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}},
                      world_size=8)
    assert cfg.batch == BatchSizes(1680, 6, 35, 8) and cfg.train_batch_size == 1680
    with pytest.raises(ConfigError, match="World size \\(9\\)"):
        load_config({"elasticity": {"enabled": True, "version": 0.1}}, world_size=9)
    with pytest.raises(ConfigError) as err:
        load_config({"elasticity": {"enabled": True, "version": 0.2, "num_gpus_per_node": 6,
                                    "model_parallel_size": 4}}, world_size=2)
    assert err.value.paths == ["elasticity.model_parallel_size"]
    # batch keys outside the section are an error unless ignored; then elasticity overrides them
    with pytest.raises(ConfigError, match="elastic"):
        load_config({"elasticity": {"enabled": True}, "train_batch_size": 8}, world_size=8)
    cfg = load_config({"elasticity": {"enabled": True, "ignore_non_elastic_batch_info": True},
                       "train_batch_size": 8}, world_size=8)
    assert cfg.train_batch_size == 1680


def test_batch_keys_beside_elastic_training_raise_deepspeeds_error_type():
    with pytest.raises(ElasticityConfigError, match="train_batch_size: elastic training is enabled") as err:
        load_config({"elasticity": {"enabled": True}, "train_batch_size": 8})
    assert err.value.paths == ["train_batch_size"]
    with pytest.raises(ConfigError) as mixed:  # with an unrelated problem, the plain ConfigError listing both
        load_config({"elasticity": {"enabled": True}, "train_batch_size": 8, "fp16": {"enabled": 3}})
    assert not isinstance(mixed.value, ElasticityError) and len(mixed.value.problems) == 2


def test_resolving_checks_the_resource_schedulers_elastic_config(monkeypatch):
    section = {"enabled": True, "max_train_batch_size": 27, "micro_batch_sizes": [1, 2, 3, 4], "version": 0.1}
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps(section))
    assert load_config({"elasticity": section}, world_size=2).train_batch_size == 24
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps({**section, "max_train_batch_size": 4}))
    with pytest.raises(ElasticityConfigError, match="seen by resource scheduler does not match"):
        load_config({"elasticity": section}, world_size=2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 24), min_size=1, max_size=4, unique=True), st.integers(48, 5000), st.booleans(),
       st.sampled_from([0.1, 0.2]))
def test_every_listed_world_size_gets_a_consistent_batch(micro, max_batch, larger, version):
    cfg = ElasticityConfig(enabled=True, max_train_batch_size=max_batch, micro_batch_sizes=micro,
                           prefer_larger_batch=larger, version=version)
    plan = elastic_plan(cfg)
    assert plan.valid_world_sizes and plan.train_batch_size <= max_batch
    for world in plan.valid_world_sizes[:5]:
        sizes = elastic_batch_sizes(cfg, world)
        assert sizes.train_batch_size == plan.train_batch_size
        assert sizes.train_micro_batch_size_per_gpu * sizes.gradient_accumulation_steps * world == \
            plan.train_batch_size
        assert sizes.train_micro_batch_size_per_gpu in micro
        got = compute_elastic_config({"elasticity": cfg.model_dump()}, "0.19.8", world_size=world)
        assert got[0] == sizes.train_batch_size and got[2] == sizes.train_micro_batch_size_per_gpu
