"""compression_training: the seven techniques, documented defaults and allowed values, reference examples."""

from __future__ import annotations

import pytest
from _ds_config_testing import CORRUPTION_SETTINGS, assert_corruption_is_a_config_error
from hypothesis import given
from hypothesis import strategies as st

from ds_config._base import validate_section
from ds_config._errors import ConfigError
from ds_config.compression import CompressionConfig

P = "compression_training"

# Defaults from the Compression chapter's tables ("All Linear and CONV2D layers" is the "*" scope).
SHARED_DEFAULTS = {
    "weight_quantization": {
        "enabled": False, "quantizer_kernel": False, "schedule_offset": 0, "quantize_groups": 1,
        "quantize_verbose": False, "quantization_type": "symmetric", "rounding": "nearest",
        "quantize_weight_in_forward": False,
        "fp16_mixed_quantize": {"enabled": False, "quantize_change_ratio": 0.001}},
    "activation_quantization": {
        "enabled": False, "quantization_type": "symmetric", "range_calibration": "static", "schedule_offset": 0},
    "sparse_pruning": {
        "enabled": False, "schedule_offset": 0, "schedule_offset_end": 0, "schedule_offset_stride": 1,
        "method": "l1", "block_pattern": "4x1", "dense_ratio": 0.1, "excluded_modules": []},
    "row_pruning": {"enabled": False, "schedule_offset": 0, "method": "l1"},
    "head_pruning": {"enabled": False, "schedule_offset": 0, "method": "topk", "num_heads": None},
    "channel_pruning": {"enabled": False, "schedule_offset": 0, "method": "l1"},
}
GROUP_DEFAULTS = {
    "weight_quantization": {"params": {"start_bits": 8, "target_bits": 8, "quantization_period": 1},
                            "modules": ["*"]},
    "activation_quantization": {"params": {"bits": 8}, "modules": ["*"]},
    "sparse_pruning": {"params": {"dense_ratio": 0.5}, "modules": ["*"]},
    "row_pruning": {"params": {"dense_ratio": 0.5}, "modules": ["*"], "related_modules": None},
    "head_pruning": {"params": {"dense_ratio": 0.5}, "modules": ["*"], "related_modules": None},
    "channel_pruning": {"params": {"dense_ratio": 0.5}, "modules": ["*"], "related_modules": None},
}

# The chapter's examples
EXAMPLES = {
    "layer_reduction": {
        "enabled": True, "keep_number_layer": 5, "module_name_prefix": "bert.encoder.layer",
        "teacher_layer": [2, 4, 6, 8, 10], "other_module_name": ["bert.pooler", "bert.embeddings", "classifier"]},
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "quantizer_kernel": False, "schedule_offset": 0, "quantize_groups": 1,
                              "quantize_verbose": False, "quantization_type": "symmetric", "rounding": "nearest",
                              "quantize_weight_in_forward": False,
                              "fp16_mixed_quantize": {"enabled": False, "quantize_change_ratio": 0.001}},
        "different_groups": {
            "wq1": {"params": {"start_bits": 8, "target_bits": 8, "quantization_period": 50},
                    "modules": ["attention.self", "intermediate"]},
            "wq2": {"params": {"start_bits": 4, "target_bits": 4, "quantization_period": 50},
                    "modules": ["attention.output"]}}},
    "activation_quantization": {
        "shared_parameters": {"enabled": True, "quantization_type": "asymmetric", "range_calibration": "dynamic",
                              "schedule_offset": 50},
        "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["attention.output"]}}},
    "sparse_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 30, "schedule_offset_end": 90,
                              "schedule_offset_stride": 15, "method": "snip_momentum", "block_pattern": "4x1",
                              "dense_ratio": 0.4, "excluded_modules": ["classifier", "pooler"]},
        "different_groups": {}},
    "row_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 20, "method": "topk"},
        "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["intermediate.dense"],
                                     "related_modules": [["layer.\\w+.output.dense"]]}}},
    "head_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 10, "method": "topk", "num_heads": 12},
        "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["attention.output.dense"],
                                     "related_modules": [["self.query", "self.key", "self.value"]]}}},
    "channel_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "topk"},
        "different_groups": {"cp1": {"params": {"dense_ratio": 0.5}, "modules": ["layer....conv1"],
                                     "related_modules": [["layer....conv2", "layer....bn1"]]}}},
}


def parse(data: dict) -> CompressionConfig:
    return validate_section(CompressionConfig, data, path=P)


def test_seven_techniques():
    # shared_parameters at the top: DeepSpeed reads it only as quantize_training's gate (unbuilt.INERT_KEYS)
    assert set(CompressionConfig.model_fields) == set(SHARED_DEFAULTS) | {"layer_reduction", "shared_parameters"}


@pytest.mark.parametrize("technique", sorted(SHARED_DEFAULTS))
def test_shared_parameter_defaults(technique):
    section = getattr(parse({}), technique)
    assert section.shared_parameters.model_dump() == SHARED_DEFAULTS[technique]
    assert section.different_groups == {}


@pytest.mark.parametrize("technique", sorted(GROUP_DEFAULTS))
def test_group_defaults(technique):
    cfg = parse({technique: {"different_groups": {"g": {}}}})
    assert getattr(cfg, technique).different_groups["g"].model_dump() == GROUP_DEFAULTS[technique]


def test_layer_reduction_defaults():
    assert parse({}).layer_reduction.model_dump() == {
        "enabled": False, "keep_number_layer": None, "module_name_prefix": None, "teacher_layer": None,
        "other_module_name": None}


@pytest.mark.parametrize("technique", sorted(EXAMPLES))
def test_reference_examples_parse(technique):
    cfg = parse({technique: EXAMPLES[technique]})
    section = getattr(cfg, technique)
    if technique != "layer_reduction":
        assert section.shared_parameters.enabled is True
        assert set(section.different_groups) == set(EXAMPLES[technique]["different_groups"])
    else:
        assert section.teacher_layer == [2, 4, 6, 8, 10]


def test_all_examples_together():
    cfg = parse(EXAMPLES)
    assert cfg.weight_quantization.different_groups["wq2"].params.start_bits == 4
    assert cfg.head_pruning.different_groups["rp1"].related_modules == [["self.query", "self.key", "self.value"]]


@pytest.mark.parametrize("where, key, value", [
    ("weight_quantization", "quantization_type", "affine"),
    ("weight_quantization", "rounding", "up"),
    ("activation_quantization", "range_calibration", "minmax"),
    ("sparse_pruning", "method", "magnitude"),
    ("row_pruning", "method", "snip_momentum"),
    ("channel_pruning", "method", "random"),
    ("head_pruning", "method", "l1"),
    ("sparse_pruning", "block_pattern", "4-1"),
    ("sparse_pruning", "dense_ratio", 1.5),
])
def test_allowed_values(where, key, value):
    with pytest.raises(ConfigError) as err:
        parse({where: {"shared_parameters": {key: value}}})
    assert err.value.paths == [f"{P}.{where}.shared_parameters.{key}"]


def test_allowed_values_accepted():
    cfg = parse({"weight_quantization": {"shared_parameters": {"quantization_type": "asymmetric",
                                                               "rounding": "stochastic"}},
                 "sparse_pruning": {"shared_parameters": {"method": "topk", "block_pattern": "2:4"}},
                 "activation_quantization": {"shared_parameters": {"range_calibration": "dynamic"}}})
    assert cfg.weight_quantization.shared_parameters.rounding == "stochastic"
    assert cfg.sparse_pruning.shared_parameters.block_pattern == "2:4"


def test_bits_rules():
    with pytest.raises(ConfigError) as err:
        parse({"weight_quantization": {"different_groups": {"g": {"params": {"start_bits": 4, "target_bits": 8}}}}})
    assert err.value.paths == [f"{P}.weight_quantization.different_groups.g.params.target_bits"]
    with pytest.raises(ConfigError) as err:
        parse({"activation_quantization": {"different_groups": {"a": {"params": {"bits": 2}}}}})
    assert err.value.paths == [f"{P}.activation_quantization.different_groups.a.params.bits"]


def test_enabled_technique_needs_groups_except_snip_momentum():
    with pytest.raises(ConfigError) as err:
        parse({"row_pruning": {"shared_parameters": {"enabled": True}}})
    assert err.value.paths == [f"{P}.row_pruning.different_groups"]
    assert parse({"sparse_pruning": EXAMPLES["sparse_pruning"]}).sparse_pruning.different_groups == {}


def test_snip_momentum_window():
    data = {"sparse_pruning": {"shared_parameters": {"enabled": True, "method": "snip_momentum",
                                                     "schedule_offset": 50, "schedule_offset_end": 10}}}
    with pytest.raises(ConfigError) as err:
        parse(data)
    assert err.value.paths == [f"{P}.sparse_pruning.shared_parameters.schedule_offset_end"]


def test_head_pruning_needs_num_heads():
    with pytest.raises(ConfigError) as err:
        parse({"head_pruning": {"shared_parameters": {"enabled": True},
                                "different_groups": {"h": {"modules": ["attention.output.dense"]}}}})
    assert err.value.paths == [f"{P}.head_pruning.shared_parameters.num_heads"]


def test_related_modules_one_list_per_module():
    with pytest.raises(ConfigError) as err:
        parse({"row_pruning": {"different_groups": {"r": {"modules": ["a", "b"], "related_modules": [["c"]]}}}})
    assert err.value.paths == [f"{P}.row_pruning.different_groups.r.related_modules"]
    with pytest.raises(ConfigError) as err:  # not a key of quantization groups
        parse({"weight_quantization": {"different_groups": {"w": {"related_modules": [["c"]]}}}})
    assert err.value.paths == [f"{P}.weight_quantization.different_groups.w.related_modules"]


def test_modules_accepts_a_single_pattern():
    cfg = parse({"sparse_pruning": {"different_groups": {"s": {"modules": "attention.self"}}}})
    assert cfg.sparse_pruning.different_groups["s"].modules == ["attention.self"]


@pytest.mark.parametrize("change, bad", [
    ({"keep_number_layer": None}, "keep_number_layer"),
    ({"teacher_layer": [2, 4]}, "teacher_layer"),
    ({"module_name_prefix": None}, "module_name_prefix"),
])
def test_layer_reduction_checks(change, bad):
    data = {k: v for k, v in {**EXAMPLES["layer_reduction"], **change}.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        parse({"layer_reduction": data})
    assert err.value.paths == [f"{P}.layer_reduction.{bad}"]


def test_layer_reduction_by_other_module_name_only():
    cfg = parse({"layer_reduction": {"enabled": True, "keep_number_layer": 2,
                                     "other_module_name": ["bert.encoder.layer.2", "bert.encoder.layer.4"]}})
    assert cfg.layer_reduction.teacher_layer is None


def test_auto_and_unknown_keys():
    cfg = parse({"weight_quantization": {"shared_parameters": {"quantize_groups": "auto"}}})
    assert cfg.weight_quantization.shared_parameters.quantize_groups == 1
    with pytest.raises(ConfigError) as err:
        parse({"weight_quantization": {"shared_parameters": {"quantize_group": 2}}})
    assert err.value.paths == [f"{P}.weight_quantization.shared_parameters.quantize_group"]
    assert "did you mean 'quantize_groups'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse({"weight_quantisation": {}})
    assert "did you mean 'weight_quantization'" in str(err.value)


# ---------------------------------------------------------------- property-based: corrupt the example anywhere

@CORRUPTION_SETTINGS
@given(data=st.data())
def test_random_corruption_is_a_config_error_with_a_path(data):
    assert_corruption_is_a_config_error(data, EXAMPLES, parse, P)
