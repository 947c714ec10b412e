"""DeepSpeed's command-line side of the learning-rate schedules (``deepspeed.add_tuning_arguments``): the
``--lr_schedule`` flags with DeepSpeed's defaults, and the ``scheduler`` config a parsed namespace stands for."""

from __future__ import annotations

import argparse
from typing import Any

from deepspeed.runtime.lr_schedule_keys import (
    CYCLE_FIRST_STAIR_COUNT,
    CYCLE_FIRST_STEP_SIZE,
    CYCLE_MAX_LR,
    CYCLE_MAX_MOM,
    CYCLE_MIN_LR,
    CYCLE_MIN_MOM,
    CYCLE_SECOND_STAIR_COUNT,
    CYCLE_SECOND_STEP_SIZE,
    DECAY_LR_RATE,
    DECAY_MOM_RATE,
    DECAY_STEP_SIZE,
    LR_RANGE_TEST,
    LR_RANGE_TEST_MIN_LR,
    LR_RANGE_TEST_STAIRCASE,
    LR_RANGE_TEST_STEP_RATE,
    LR_RANGE_TEST_STEP_SIZE,
    LR_SCHEDULE,
    ONE_CYCLE,
    VALID_LR_SCHEDULES,
    WARMUP_LOG_RATE,
    WARMUP_MAX_LR,
    WARMUP_MIN_LR,
    WARMUP_NUM_STEPS,
    WARMUP_TYPE,
)

__all__ = ["add_tuning_arguments", "get_config_from_args", "get_lr_from_config", "parse_arguments"]

# (flag, type, default, which schedule reads it)
_FLAGS: list[tuple[str, type, Any, str]] = [
    (LR_RANGE_TEST_MIN_LR, float, 0.001, LR_RANGE_TEST),
    (LR_RANGE_TEST_STEP_RATE, float, 1.0, LR_RANGE_TEST),
    (LR_RANGE_TEST_STEP_SIZE, int, 1000, LR_RANGE_TEST),
    (LR_RANGE_TEST_STAIRCASE, bool, False, LR_RANGE_TEST),
    (CYCLE_FIRST_STEP_SIZE, int, 1000, ONE_CYCLE),
    (CYCLE_FIRST_STAIR_COUNT, int, -1, ONE_CYCLE),
    (CYCLE_SECOND_STEP_SIZE, int, -1, ONE_CYCLE),
    (CYCLE_SECOND_STAIR_COUNT, int, -1, ONE_CYCLE),
    (DECAY_STEP_SIZE, int, 1000, ONE_CYCLE),
    (CYCLE_MIN_LR, float, 0.01, ONE_CYCLE),
    (CYCLE_MAX_LR, float, 0.1, ONE_CYCLE),
    (DECAY_LR_RATE, float, 0.0, ONE_CYCLE),
    (CYCLE_MIN_MOM, float, 0.8, ONE_CYCLE),
    (CYCLE_MAX_MOM, float, 0.9, ONE_CYCLE),
    (DECAY_MOM_RATE, float, 0.0, ONE_CYCLE),
    (WARMUP_MIN_LR, float, 0, "warmup"),
    (WARMUP_MAX_LR, float, 0.001, "warmup"),
    (WARMUP_NUM_STEPS, int, 1000, "warmup"),
    (WARMUP_TYPE, str, WARMUP_LOG_RATE, "warmup"),
]


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's "Convergence Tuning" flags (``--lr_schedule`` and each schedule's parameters)."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument(f"--{LR_SCHEDULE}", type=str, default=None, help="LR schedule for training.")
    for name, kind, default, schedule in _FLAGS:
        group.add_argument(f"--{name}", type=kind, default=default, help=f"{schedule} parameter {name}.")
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    """The tuning flags of ``sys.argv`` (unknown flags are returned, not rejected)."""
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def get_config_from_args(args: Any) -> tuple[dict[str, Any] | None, str | None]:
    """``({"type": ..., "params": {...}}, None)`` for ``--lr_schedule``, or ``(None, why)``."""
    schedule = getattr(args, LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{LR_SCHEDULE} not specified on command line"
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not supported LR schedule"
    family = schedule if schedule in (LR_RANGE_TEST, ONE_CYCLE) else "warmup"
    params = {name: getattr(args, name) for name, _, _, owner in _FLAGS
              if owner == family and getattr(args, name, None) is not None}
    return {"type": schedule, "params": params}, None


def get_lr_from_config(config: dict[str, Any]) -> tuple[float | None, str]:
    """The learning rate a schedule config starts from (range test: its min, OneCycle: its max, warmup: its max)."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    schedule, params = config["type"], config["params"]
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a valid LR schedule"
    if schedule == LR_RANGE_TEST:
        return params[LR_RANGE_TEST_MIN_LR], ""
    if schedule == ONE_CYCLE:
        return params[CYCLE_MAX_LR], ""
    return params[WARMUP_MAX_LR], ""
