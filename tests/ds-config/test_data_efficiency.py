"""data_efficiency: defaults, the reference example, required keys once a feature is enabled, full key paths."""

from __future__ import annotations

import copy

import pytest
from _ds_config_testing import CORRUPTION_SETTINGS, assert_corruption_is_a_config_error
from hypothesis import given
from hypothesis import strategies as st

from ds_config._base import validate_section
from ds_config._errors import ConfigError
from ds_config.data_efficiency import DataEfficiencyConfig

# The reference's example (config reference, "Data Efficiency")
REFERENCE_EXAMPLE = {
    "enabled": True,
    "seed": 1234,
    "data_routing": {
        "enabled": True,
        "random_ltd": {
            "enabled": True, "total_layer_num": 24, "random_ltd_layer_num": 22,
            "random_ltd_layer_id": list(range(1, 23)), "model_mask_name": "attention_mask",
            "model_type": "decoder", "hidden_state_order": "seq_batch_dim",
            "random_ltd_schedule": {"min_value": 128, "max_value": 2048, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": 200000, "seq_per_step": 16}},
        },
    },
    "data_sampling": {
        "enabled": True, "num_epochs": 1, "num_workers": 0,
        "curriculum_learning": {
            "enabled": True, "data_cluster_path": "/path/to/data_clusters",
            "curriculum_metrics": {
                "vocabularyrarity": {
                    "index_to_sample_path": "/path/to/index_to_sample",
                    "index_to_metric_path": "/path/to/index_to_metric",
                    "difficulty_type": "percentile", "clustering_type": "schedule_based",
                    "min_difficulty": 1, "max_difficulty": 100, "schedule_type": "fixed_root",
                    "schedule_config": {"total_curriculum_step": 110000, "difficulty_step": 1, "root_degree": 2},
                },
            },
        },
    },
}

P = "data_efficiency"
LTD = f"{P}.data_routing.random_ltd"
METRIC = f"{P}.data_sampling.curriculum_learning.curriculum_metrics.vocabularyrarity"


def parse(data: dict) -> DataEfficiencyConfig:
    return validate_section(DataEfficiencyConfig, data, path=P)


def example() -> dict:
    return copy.deepcopy(REFERENCE_EXAMPLE)


def test_documented_defaults():
    cfg = parse({})
    assert (cfg.enabled, cfg.seed) == (False, 1234)
    ds = cfg.data_sampling
    assert (ds.enabled, ds.num_epochs, ds.num_workers) == (False, 1000, 0)
    assert ds.curriculum_learning.enabled is False and ds.curriculum_learning.curriculum_metrics == {}
    assert cfg.data_routing.enabled is False and cfg.data_routing.random_ltd.enabled is False
    assert cfg.data_routing.random_ltd.random_ltd_schedule.schedule_type == "fixed_linear"
    assert cfg.data_routing.random_ltd.layer_token_lr_schedule.enabled is False


def test_dynamic_batching_defaults():
    db = parse({}).data_sampling.dynamic_batching
    assert db.model_dump() == {
        "enabled": False, "metrics_path": None, "seqlen_sample_to_metric_path": None, "lr_scaling_method": "linear",
        "min_batch_size": 1, "max_batch_size": None, "sequence_picking_order": "dataloader", "max_tokens": None,
        "verbose": False}
    assert db.seqlen_file_prefix() is None
    assert parse({}).data_sampling.pin_memory is False  # DeepSpeed's data_sampling.pin_memory


def test_reference_example_parses():
    cfg = parse(example())
    ltd = cfg.data_routing.random_ltd
    assert ltd.random_ltd_layer_num == 22 and ltd.random_ltd_schedule.schedule_config.seq_per_step == 16
    metric = cfg.data_sampling.curriculum_learning.curriculum_metrics["vocabularyrarity"]
    assert metric.schedule_type == "fixed_root" and metric.schedule_config.root_degree == 2


def test_auto_means_default():
    cfg = parse({"seed": "auto",
                 "data_sampling": {"num_epochs": "auto", "dynamic_batching": {"min_batch_size": "auto"}}})
    assert cfg.seed == 1234 and cfg.data_sampling.num_epochs == 1000
    assert cfg.data_sampling.dynamic_batching.min_batch_size == 1


@pytest.mark.parametrize("key", ["total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "model_mask_name",
                                 "model_type", "hidden_state_order"])
def test_random_ltd_required_keys(key):
    data = example()
    del data["data_routing"]["random_ltd"][key]
    with pytest.raises(ConfigError) as err:
        parse(data)
    assert err.value.paths == [f"{LTD}.{key}"]
    assert "required when random-LTD is enabled" in str(err.value)


@pytest.mark.parametrize("key", ["require_steps", "seq_per_step"])
def test_random_ltd_schedule_required_keys(key):
    data = example()
    del data["data_routing"]["random_ltd"]["random_ltd_schedule"]["schedule_config"][key]
    with pytest.raises(ConfigError) as err:
        parse(data)
    assert err.value.paths == [f"{LTD}.random_ltd_schedule.schedule_config.{key}"]


def test_random_ltd_layer_ids_match_count_and_depth():
    data = example()
    data["data_routing"]["random_ltd"]["random_ltd_layer_num"] = 3
    with pytest.raises(ConfigError) as err:
        parse(data)
    assert err.value.paths == [f"{LTD}.random_ltd_layer_id"]
    data = example()
    data["data_routing"]["random_ltd"]["random_ltd_layer_id"][0] = 24
    with pytest.raises(ConfigError, match="outside 0..23"):
        parse(data)


def test_random_ltd_disabled_needs_nothing_and_bad_enums():
    assert parse({"data_routing": {"random_ltd": {"enabled": False}}}).data_routing.random_ltd.model_type is None
    data = example()
    data["data_routing"]["random_ltd"]["model_type"] = "encoder-decoder"
    with pytest.raises(ConfigError) as err:
        parse(data)
    assert err.value.paths == [f"{LTD}.model_type"]


def test_random_ltd_schedule_range():
    data = example()
    data["data_routing"]["random_ltd"]["random_ltd_schedule"]["min_value"] = 4096
    with pytest.raises(ConfigError) as err:
        parse(data)
    assert err.value.paths == [f"{LTD}.random_ltd_schedule.max_value"]


@pytest.mark.parametrize("key", ["difficulty_type", "clustering_type", "min_difficulty", "max_difficulty",
                                 "schedule_type", "index_to_sample_path", "index_to_metric_path"])
def test_curriculum_metric_required_keys(key):
    data = example()
    metric = data["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["vocabularyrarity"]
    del metric[key]
    if key == "index_to_metric_path":  # only difficulty_type 'value' reads it (as DeepSpeed's sampler)
        parse(data)
        metric.update(difficulty_type="value")
    with pytest.raises(ConfigError) as err:
        parse(data)
    assert err.value.paths == [f"{METRIC}.{key}"]
    assert f"'{key}' is required" in str(err.value)


def test_single_cluster_needs_no_index_files():
    data = example()
    metric = data["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["vocabularyrarity"]
    metric.update(clustering_type="single_cluster")
    del metric["index_to_sample_path"], metric["index_to_metric_path"]
    assert parse(data).data_sampling.curriculum_learning.curriculum_metrics["vocabularyrarity"].index_to_sample_path \
        is None


def test_curriculum_metric_schedule_keys_depend_on_schedule_type():
    data = example()
    metric = data["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["vocabularyrarity"]
    metric["schedule_type"] = "fixed_linear"
    with pytest.raises(ConfigError) as err:
        parse(data)
    assert err.value.paths == [f"{METRIC}.schedule_config.root_degree"]
    assert "not used by schedule_type 'fixed_linear'" in str(err.value)
    metric["schedule_type"] = "custom"
    del metric["schedule_config"]
    assert parse(data).data_sampling.curriculum_learning.curriculum_metrics["vocabularyrarity"].schedule_config \
        is None


def test_percentile_range_and_order():
    data = example()
    metric = data["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["vocabularyrarity"]
    metric["max_difficulty"] = 101
    with pytest.raises(ConfigError) as err:
        parse(data)
    assert err.value.paths == [f"{METRIC}.max_difficulty"]
    metric.update(min_difficulty=0, max_difficulty=0)  # zero percentiles: the sampler would divide by zero
    with pytest.raises(ConfigError, match="percentile max_difficulty must be within 1..100") as err:
        parse(data)
    assert err.value.paths == [f"{METRIC}.max_difficulty"]
    metric.update(difficulty_type="value", min_difficulty=50, max_difficulty=10)
    with pytest.raises(ConfigError, match="max_difficulty must be >= min_difficulty"):
        parse(data)


def test_enabled_sampling_curriculum_needs_cluster_path_and_metrics():
    data = example()
    del data["data_sampling"]["curriculum_learning"]["data_cluster_path"]
    with pytest.raises(ConfigError) as err:
        parse(data)
    assert err.value.paths == [f"{P}.data_sampling.curriculum_learning.data_cluster_path"]
    data = example()
    data["data_sampling"]["curriculum_learning"]["curriculum_metrics"] = {}
    with pytest.raises(ConfigError, match="at least one metric"):
        parse(data)


def test_dynamic_batching_checks():
    with pytest.raises(ConfigError) as err:
        parse({"data_sampling": {"dynamic_batching": {"enabled": True}}})
    assert err.value.paths == [f"{P}.data_sampling.dynamic_batching.max_tokens"]
    with pytest.raises(ConfigError) as err:
        parse({"data_sampling": {"dynamic_batching": {"min_batch_size": 4, "max_batch_size": 2}}})
    assert err.value.paths == [f"{P}.data_sampling.dynamic_batching.max_batch_size"]
    with pytest.raises(ConfigError) as err:
        parse({"data_sampling": {"dynamic_batching": {"lr_scaling_method": "cubic"}}})
    assert err.value.paths == [f"{P}.data_sampling.dynamic_batching.lr_scaling_method"]
    ok = parse({"data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens": 4096}}})
    assert ok.data_sampling.dynamic_batching.max_tokens == 4096
    with pytest.raises(ConfigError) as err:
        parse({"data_sampling": {"dynamic_batching": {"sequence_picking_order": "shortest"}}})
    assert err.value.paths == [f"{P}.data_sampling.dynamic_batching.sequence_picking_order"]
    assert "'random'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse({"data_sampling": {"dynamic_batching": {"metrics_path": "a", "seqlen_sample_to_metric_path": "b"}}})
    assert err.value.paths == [f"{P}.data_sampling.dynamic_batching.seqlen_sample_to_metric_path"]


def test_dynamic_batching_first_release_names_are_deprecated():
    with pytest.warns(FutureWarning, match="'max_tokens_per_batch' is deprecated; use 'max_tokens'"):
        db = parse({"data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens_per_batch": 64,
                                                           "samples_order": "seqlen"}}}).data_sampling.dynamic_batching
    assert db.max_tokens == 64 and db.sequence_picking_order == "seqlen"
    assert "max_tokens_per_batch" not in db.model_dump() and "samples_order" not in db.model_dump()
    with pytest.raises(ConfigError, match="give only 'max_tokens'"):
        parse({"data_sampling": {"dynamic_batching": {"max_tokens_per_batch": 64, "max_tokens": 32}}})


def test_dynamic_batching_seqlen_file_prefix():
    db = parse({"data_sampling": {"dynamic_batching": {"metrics_path": "/m/"}}}).data_sampling.dynamic_batching
    assert db.seqlen_file_prefix() == "/m/seqlen/seqlen_sample_to_metric"
    db = parse({"data_sampling": {"dynamic_batching": {"seqlen_sample_to_metric_path": "/x/len"}}})
    assert db.data_sampling.dynamic_batching.seqlen_file_prefix() == "/x/len"


def test_unknown_key_did_you_mean_and_non_strict():
    with pytest.raises(ConfigError) as err:
        parse({"data_sampling": {"num_epoch": 3}})
    assert err.value.paths == [f"{P}.data_sampling.num_epoch"]
    assert "did you mean 'num_epochs'" in str(err.value)
    with pytest.warns(UserWarning, match="data_sampling.num_epoch"):
        cfg = validate_section(DataEfficiencyConfig, {"data_sampling": {"num_epoch": 3}}, path=P, strict=False)
    assert cfg.data_sampling.num_epochs == 1000


def test_layer_token_lr_schedule():
    with pytest.raises(ConfigError) as err:
        parse({"data_routing": {"random_ltd": {"layer_token_lr_schedule": {"enabled": True}}}})
    assert err.value.paths == [f"{LTD}.layer_token_lr_schedule.total_layer_tokens"]


# ---------------------------------------------------------------- property-based: corrupt the example anywhere

@CORRUPTION_SETTINGS
@given(data=st.data())
def test_random_corruption_is_a_config_error_with_a_path(data):
    assert_corruption_is_a_config_error(data, REFERENCE_EXAMPLE, parse, P)
