"""ZenFlow's schedule (ds_zero.zenflow.plan): which steps re-select columns and which take the full CPU step."""

from __future__ import annotations

from ds_config.zero import ZenFlowConfig
from ds_zero.zenflow import ZenFlowPlan


def _steps(plan: ZenFlowPlan, n: int, predicate) -> list[int]:
    return [t for t in range(n) if predicate(plan, t)]


def test_step_strategy_with_warm_up():
    plan = ZenFlowPlan.from_config(ZenFlowConfig(select_strategy="step", select_interval=6, update_interval=3,
                                                 full_warm_up_rounds=2))
    assert plan.select_interval == 6
    # warm-up steps 0 and 1 are full steps; then every 3rd step counted from the warm-up, and the step before
    # each re-selection (6, 12)
    assert _steps(plan, 14, ZenFlowPlan.updates_at) == [0, 1, 4, 5, 7, 10, 11, 13]
    assert _steps(plan, 14, ZenFlowPlan.selects_at) == [2, 6, 12]


def test_epoch_strategies_wait_for_the_epoch_length():
    auto = ZenFlowPlan.from_config(ZenFlowConfig(update_interval=2))
    assert auto.select_interval == 0 and _steps(auto, 10, ZenFlowPlan.selects_at) == [0]
    assert _steps(auto.for_epoch_length(4), 10, ZenFlowPlan.selects_at) == [0, 4, 8]
    epoch = ZenFlowPlan.from_config(ZenFlowConfig(select_strategy="epoch", select_interval=2, update_interval=2))
    assert epoch.for_epoch_length(3).select_interval == 6
    step = ZenFlowPlan.from_config(ZenFlowConfig(select_strategy="step", select_interval=4, update_interval=2))
    assert step.for_epoch_length(100) == step
