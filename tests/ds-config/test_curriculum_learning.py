"""Legacy top-level curriculum_learning: defaults, the reference example, schedule-dependent required keys."""

from __future__ import annotations

import pytest
from _ds_config_testing import CORRUPTION_SETTINGS, assert_corruption_is_a_config_error
from hypothesis import given
from hypothesis import strategies as st

from ds_config._base import validate_section
from ds_config._errors import ConfigError
from ds_config.data_efficiency import SCHEDULE_KEYS, CurriculumLearningConfig

P = "curriculum_learning"
REFERENCE_EXAMPLE = {
    "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 1024,
    "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 40000, "difficulty_step": 8},
}
FULL_SCHEDULE = {"total_curriculum_step": 100, "difficulty_step": 8, "root_degree": 2, "difficulty": [8, 64, 512],
                 "max_step": [10, 20]}


def parse(data: dict) -> CurriculumLearningConfig:
    return validate_section(CurriculumLearningConfig, data, path=P)


def config(schedule_type: str, **schedule: object) -> dict:
    return {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 512,
            "schedule_type": schedule_type, "schedule_config": dict(schedule)}


def test_documented_defaults():
    cfg = parse({})
    assert cfg.model_dump() == {"enabled": False, "curriculum_type": None, "min_difficulty": None,
                                "max_difficulty": None, "schedule_type": None, "schedule_config": None}


def test_reference_example_parses():
    cfg = parse(REFERENCE_EXAMPLE)
    assert cfg.schedule_config.total_curriculum_step == 40000 and cfg.schedule_config.difficulty_step == 8


def test_schedule_keys_match_the_reference():
    assert SCHEDULE_KEYS["fixed_linear"] == ("total_curriculum_step", "difficulty_step")
    assert SCHEDULE_KEYS["fixed_root"] == ("total_curriculum_step", "difficulty_step", "root_degree")
    assert SCHEDULE_KEYS["fixed_discrete"] == ("difficulty", "max_step")


@pytest.mark.parametrize("schedule_type", ["fixed_linear", "fixed_root", "fixed_discrete"])
def test_each_schedule_with_exactly_its_keys_parses(schedule_type):
    keys = {k: FULL_SCHEDULE[k] for k in SCHEDULE_KEYS[schedule_type]}
    cfg = parse(config(schedule_type, **keys))
    assert cfg.schedule_type == schedule_type
    for key, value in keys.items():
        assert getattr(cfg.schedule_config, key) == value


@pytest.mark.parametrize("schedule_type, missing", [(st, key) for st in ("fixed_linear", "fixed_root", "fixed_discrete")
                                                    for key in SCHEDULE_KEYS[st]])
def test_missing_schedule_key_is_named(schedule_type, missing):
    keys = {k: FULL_SCHEDULE[k] for k in SCHEDULE_KEYS[schedule_type] if k != missing}
    with pytest.raises(ConfigError) as err:
        parse(config(schedule_type, **keys))
    assert err.value.paths == [f"{P}.schedule_config.{missing}"]
    assert f"'{missing}' is required in schedule_config for schedule_type '{schedule_type}'" in str(err.value)


def test_key_of_another_schedule_is_an_error():
    with pytest.raises(ConfigError) as err:
        parse(config("fixed_linear", total_curriculum_step=10, difficulty_step=8, root_degree=2))
    assert err.value.paths == [f"{P}.schedule_config.root_degree"]
    assert "fixed_linear" in str(err.value)


def test_missing_schedule_config_and_custom():
    data = config("fixed_root")
    del data["schedule_config"]
    with pytest.raises(ConfigError) as err:
        parse(data)
    assert err.value.paths == [f"{P}.schedule_config"]
    assert "root_degree" in str(err.value)
    data["schedule_type"] = "custom"
    assert parse(data).schedule_config is None


def test_fixed_discrete_lengths():
    with pytest.raises(ConfigError) as err:
        parse(config("fixed_discrete", difficulty=[8, 64], max_step=[10, 20]))
    assert err.value.paths == [f"{P}.schedule_config.max_step"]


@pytest.mark.parametrize("key", ["curriculum_type", "min_difficulty", "max_difficulty", "schedule_type"])
def test_enabled_requires(key):
    data = dict(REFERENCE_EXAMPLE)
    del data[key]
    with pytest.raises(ConfigError) as err:
        parse(data)
    assert err.value.paths == [f"{P}.{key}"]


def test_disabled_needs_nothing_but_checks_what_is_given():
    assert parse({"enabled": False, "min_difficulty": 8}).min_difficulty == 8
    with pytest.raises(ConfigError) as err:
        parse({"curriculum_type": "vocab_rarity"})
    assert err.value.paths == [f"{P}.curriculum_type"] and "seqlen" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse({"schedule_type": "fixed_cubic"})
    assert err.value.paths == [f"{P}.schedule_type"]
    with pytest.raises(ConfigError) as err:
        parse({"min_difficulty": 64, "max_difficulty": 8})
    assert err.value.paths == [f"{P}.max_difficulty"]


def test_bad_values_and_auto():
    with pytest.raises(ConfigError) as err:
        parse(config("fixed_linear", total_curriculum_step=0, difficulty_step=8))
    assert err.value.paths == [f"{P}.schedule_config.total_curriculum_step"]
    assert parse({"enabled": "auto"}).enabled is False
    with pytest.raises(ConfigError) as err:
        parse({"schedule_config": {"difficulty_steps": 8}})
    assert "did you mean 'difficulty_step'" in str(err.value)


# ---------------------------------------------------------------- property-based: corrupt the example anywhere

@CORRUPTION_SETTINGS
@given(data=st.data())
def test_random_corruption_is_a_config_error_with_a_path(data):
    assert_corruption_is_a_config_error(data, REFERENCE_EXAMPLE, parse, P)
