"""sparse_attention: the five modes, their keys and defaults (config reference, "Sparse Attention")."""

from __future__ import annotations

import pytest
from _ds_config_testing import CORRUPTION_SETTINGS, assert_corruption_is_a_config_error
from hypothesis import given
from hypothesis import strategies as st

from ds_config._base import validate_section
from ds_config._errors import ConfigError
from ds_config.sparse_attention import MODE_FIELDS, SparseAttentionConfig

# The reference's table (its last column is labelled "Example"; these are the values DeepSpeed falls back to,
# which agree with that column except num_different_global_patterns, whose example is 4 and default 1).
DOCUMENTED_DEFAULTS = {
    "mode": "fixed",
    "block": 16,
    "different_layout_per_head": False,
    "num_local_blocks": 4,
    "num_global_blocks": 1,
    "attention": "bidirectional",
    "horizontal_global_attention": False,
    "num_different_global_patterns": 1,
    "num_random_blocks": 0,
    "local_window_blocks": [4],
    "global_block_indices": [0],
    "global_block_end_indices": None,
    "num_sliding_window_blocks": 3,
}

# "used in ..." per key, as the reference states it
DOCUMENTED_USE = {
    "num_local_blocks": {"fixed"},
    "num_global_blocks": {"fixed", "bigbird"},
    "attention": {"fixed", "variable"},
    "horizontal_global_attention": {"fixed", "variable"},
    "num_different_global_patterns": {"fixed"},
    "num_random_blocks": {"variable", "bigbird"},
    "local_window_blocks": {"variable"},
    "global_block_indices": {"variable", "bslongformer"},
    "global_block_end_indices": {"variable", "bslongformer"},
    "num_sliding_window_blocks": {"bigbird", "bslongformer"},
}

# a non-default value for every mode-specific key
OTHER_VALUE = {
    "num_local_blocks": 8, "num_global_blocks": 2, "attention": "unidirectional",
    "horizontal_global_attention": True, "num_different_global_patterns": 2, "num_random_blocks": 2,
    "local_window_blocks": [2, 4], "global_block_indices": [0, 8], "global_block_end_indices": [1, 9],
    "num_sliding_window_blocks": 5,
}

REFERENCE_EXAMPLE = {
    "mode": "fixed", "block": 16, "different_layout_per_head": True, "num_local_blocks": 4,
    "num_global_blocks": 1, "attention": "bidirectional", "horizontal_global_attention": False,
    "num_different_global_patterns": 4, "num_random_blocks": 0, "local_window_blocks": [4],
    "global_block_indices": [0], "global_block_end_indices": None, "num_sliding_window_blocks": 3,
}


def parse(data: dict) -> SparseAttentionConfig:
    return validate_section(SparseAttentionConfig, data, path="sparse_attention")


def test_documented_defaults():
    cfg = parse({})
    assert cfg.model_dump() == DOCUMENTED_DEFAULTS
    assert len(SparseAttentionConfig.model_fields) == len(DOCUMENTED_DEFAULTS) == 13


def test_mode_keys_match_the_reference():
    for key, modes in DOCUMENTED_USE.items():
        assert {m for m, keys in MODE_FIELDS.items() if key in keys} == modes, key
    for keys in MODE_FIELDS.values():
        assert keys[:2] == ("block", "different_layout_per_head")


def test_reference_example_parses():
    cfg = parse(REFERENCE_EXAMPLE)
    assert cfg.mode == "fixed" and cfg.different_layout_per_head and cfg.num_different_global_patterns == 4


@pytest.mark.parametrize("mode", sorted(MODE_FIELDS))
def test_each_mode_accepts_its_keys(mode):
    data = {"mode": mode, "block": 32}
    for key in MODE_FIELDS[mode][2:]:
        data[key] = OTHER_VALUE[key]
    if mode in ("fixed", "variable"):
        data["attention"] = "bidirectional"  # horizontal global attention needs it
    if mode == "fixed":
        data["different_layout_per_head"] = True
    cfg = parse(data)
    params = cfg.layout_params()
    assert set(params) == set(MODE_FIELDS[mode])
    assert params["block"] == 32
    for key in MODE_FIELDS[mode][2:]:
        assert params[key] == data[key]


@pytest.mark.parametrize("mode", sorted(MODE_FIELDS))
def test_foreign_key_names_mode_and_accepted_keys(mode):
    foreign = next(k for k in DOCUMENTED_USE if mode not in DOCUMENTED_USE[k])
    with pytest.raises(ConfigError) as err:
        parse({"mode": mode, foreign: OTHER_VALUE[foreign]})
    assert err.value.paths == [f"sparse_attention.{foreign}"]
    text = str(err.value)
    assert f"mode '{mode}'" in text
    for key in MODE_FIELDS[mode]:
        assert key in text


def test_fixed_rejects_num_random_blocks_with_full_path():
    with pytest.raises(ConfigError) as err:
        parse({"mode": "fixed", "num_random_blocks": 2})
    assert err.value.paths == ["sparse_attention.num_random_blocks"]
    assert "(got 2)" in str(err.value)


def test_foreign_key_at_default_is_harmless():
    cfg = parse({"mode": "bigbird", "local_window_blocks": [4], "attention": "bidirectional"})
    assert "local_window_blocks" not in cfg.layout_params()


def test_assignment_revalidates_against_the_mode():
    cfg = parse({"mode": "bigbird", "num_random_blocks": 2})
    cfg.block = 32
    assert cfg.layout_params()["block"] == 32 and cfg.global_block_end_indices is None
    with pytest.raises(ValueError, match="not used by sparse attention mode 'fixed'"):
        cfg.mode = "fixed"


def test_auto_means_default():
    cfg = parse({"mode": "auto", "block": "auto", "num_local_blocks": "auto"})
    assert cfg.mode == "fixed" and cfg.block == 16 and cfg.num_local_blocks == 4
    assert parse({"mode": "dense", "num_random_blocks": "auto"}).mode == "dense"


def test_unknown_mode_and_typo():
    with pytest.raises(ConfigError) as err:
        parse({"mode": "longformer"})
    assert err.value.paths == ["sparse_attention.mode"]
    assert "bslongformer" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse({"mode": "bigbird", "num_random_block": 1})
    assert err.value.paths == ["sparse_attention.num_random_block"]
    assert "did you mean 'num_random_blocks'" in str(err.value)


def test_horizontal_global_attention_needs_bidirectional():
    with pytest.raises(ConfigError) as err:
        parse({"mode": "variable", "attention": "unidirectional", "horizontal_global_attention": True})
    assert err.value.paths == ["sparse_attention.horizontal_global_attention"]
    assert "bidirectional" in str(err.value)


@pytest.mark.parametrize("ends, why", [([3], "same length"), ([0, 9], "greater than its start")])
def test_global_block_end_indices(ends, why):
    with pytest.raises(ConfigError) as err:
        parse({"mode": "bslongformer", "global_block_indices": [0, 8], "global_block_end_indices": ends})
    assert err.value.paths == ["sparse_attention.global_block_end_indices"]
    assert why in str(err.value)


def test_fixed_layout_constraints():
    with pytest.raises(ConfigError, match="divisible"):
        parse({"mode": "fixed", "num_local_blocks": 4, "num_global_blocks": 3})
    with pytest.raises(ConfigError, match="different_layout_per_head"):
        parse({"mode": "fixed", "num_different_global_patterns": 2})
    with pytest.raises(ConfigError, match="at most"):
        parse({"mode": "fixed", "different_layout_per_head": True, "num_local_blocks": 4,
               "num_global_blocks": 2, "num_different_global_patterns": 3})


@pytest.mark.parametrize("key, value", [("block", 0), ("num_random_blocks", -1), ("local_window_blocks", []),
                                        ("attention", "causal")])
def test_bad_values_name_key(key, value):
    mode = "variable" if key in ("num_random_blocks", "local_window_blocks") else "fixed"
    with pytest.raises(ConfigError) as err:
        parse({"mode": mode, key: value})
    assert err.value.paths == [f"sparse_attention.{key}"]


# ---------------------------------------------------------------- property-based: corrupt the example anywhere

@CORRUPTION_SETTINGS
@given(data=st.data())
def test_random_corruption_is_a_config_error_with_a_path(data):
    assert_corruption_is_a_config_error(data, REFERENCE_EXAMPLE, parse, "sparse_attention")
