"""zero_optimization.zenflow: DeepSpeed's keys and defaults, what DeepSpeed's own tests build, and errors that
name the key, the value and what is accepted."""

from __future__ import annotations

import pytest
from _ds_config_testing import config_error

from ds_config._base import validate_section
from ds_config.zero import DeepSpeedZeroConfig, ZenFlowConfig

P = "zero_optimization.zenflow"


def zero(zenflow, **section) -> DeepSpeedZeroConfig:
    return validate_section(DeepSpeedZeroConfig, {"stage": 2, **section, "zenflow": zenflow}, path="zero_optimization")


def test_defaults_are_deepspeeds():
    cfg = zero({}).zenflow
    assert (cfg.topk_ratio, cfg.select_strategy, cfg.select_interval, cfg.update_interval) == (0.1, "auto", "auto",
                                                                                              "auto")
    assert (cfg.overlap_step, cfg.offload, cfg.auto_ratio, cfg.full_warm_up_rounds) == (False, False, 0.99, 0)
    assert cfg.pt_reserved_cores_perc == 0.5 and cfg.steps_per_epoch is None


def test_epoch_strategy_without_steps_per_epoch_is_accepted_and_the_engine_fills_it():
    cfg = zero({"select_strategy": "epoch", "select_interval": 3, "update_interval": 6},
               offload_optimizer={"device": "cpu"}).zenflow
    assert isinstance(cfg, ZenFlowConfig) and cfg.steps_per_epoch is None
    cfg.steps_per_epoch = 12  # what the engine does once it knows the dataloader's length
    assert "steps_per_epoch" not in cfg.model_dump()


def test_auto_strategy_keeps_a_fixed_interval_as_deepspeeds_config_does():
    cfg = zero({"topk_ratio": 0.25, "select_interval": 4, "update_interval": 8, "full_warm_up_rounds": 1,
                "overlap_step": True}).zenflow
    assert (cfg.topk_ratio, cfg.select_interval, cfg.update_interval, cfg.full_warm_up_rounds) == (0.25, 4, 8, 1)
    assert cfg.overlap_step is True


@pytest.mark.parametrize("zenflow, key, value, accepted", [
    ({"select_strategy": "sometimes"}, "select_strategy", "'sometimes'", "'auto', 'step' or 'epoch'"),
    ({"topk_ratio": 1.5}, "topk_ratio", "1.5", "less than or equal to 1"),
    ({"auto_ratio": -0.1}, "auto_ratio", "-0.1", "greater than or equal to 0"),
    ({"pt_reserved_cores_perc": 2}, "pt_reserved_cores_perc", "2", "less than or equal to 1"),
    ({"select_interval": "often"}, "select_interval", "'often'", "an integer or 'auto'"),
    ({"update_interval": 0}, "update_interval", "0", "greater than or equal to 1 or 'auto'"),
    ({"full_warm_up_rounds": -2}, "full_warm_up_rounds", "-2", "greater than or equal to 0"),
    ({"offload": "yes"}, "offload", "'yes'", "boolean"),
    ({"select_strategy": "step"}, "select_interval", "'auto'", "integer >= 1 with select_strategy 'step'"),
    ({"select_strategy": "epoch"}, "select_interval", "'auto'", "integer >= 1 with select_strategy 'epoch'"),
    ({"select_strategy": "step", "select_interval": 2, "update_interval": 4}, "select_interval", "2",
     ">= update_interval (4)"),
])
def test_errors_name_key_value_and_what_is_accepted(zenflow, key, value, accepted):
    err = config_error(zero, zenflow)
    assert err.paths == [f"{P}.{key}"]
    message = str(err)
    assert f"{P}.{key}" in message and f"(got {value})" in message and accepted in message


def test_unknown_key_is_refused_with_a_suggestion():
    err = config_error(zero, {"topk_ration": 0.2})
    assert err.paths == [f"{P}.topk_ration"] and "topk_ratio" in str(err)


def test_step_strategy_with_intervals_in_order():
    cfg = zero({"select_strategy": "step", "select_interval": 4, "update_interval": 4}).zenflow
    assert (cfg.select_strategy, cfg.select_interval, cfg.update_interval) == ("step", 4, 4)
