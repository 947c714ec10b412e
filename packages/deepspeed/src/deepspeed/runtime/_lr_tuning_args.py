"""DeepSpeed's command-line side of the LR schedules (``deepspeed.add_tuning_arguments``): the ``--lr_schedule``
flags with DeepSpeed's defaults, and the ``scheduler`` config a parsed namespace stands for."""

from __future__ import annotations

import argparse
from typing import Any

from deepspeed.runtime import lr_schedules as s

# (flag, type, default, which schedule reads it)
_FLAGS: list[tuple[str, type, Any, str]] = [
    (s.LR_RANGE_TEST_MIN_LR, float, 0.001, s.LR_RANGE_TEST),
    (s.LR_RANGE_TEST_STEP_RATE, float, 1.0, s.LR_RANGE_TEST),
    (s.LR_RANGE_TEST_STEP_SIZE, int, 1000, s.LR_RANGE_TEST),
    (s.LR_RANGE_TEST_STAIRCASE, bool, False, s.LR_RANGE_TEST),
    (s.CYCLE_FIRST_STEP_SIZE, int, 1000, s.ONE_CYCLE),
    (s.CYCLE_FIRST_STAIR_COUNT, int, -1, s.ONE_CYCLE),
    (s.CYCLE_SECOND_STEP_SIZE, int, -1, s.ONE_CYCLE),
    (s.CYCLE_SECOND_STAIR_COUNT, int, -1, s.ONE_CYCLE),
    (s.DECAY_STEP_SIZE, int, 1000, s.ONE_CYCLE),
    (s.CYCLE_MIN_LR, float, 0.01, s.ONE_CYCLE),
    (s.CYCLE_MAX_LR, float, 0.1, s.ONE_CYCLE),
    (s.DECAY_LR_RATE, float, 0.0, s.ONE_CYCLE),
    (s.CYCLE_MIN_MOM, float, 0.8, s.ONE_CYCLE),
    (s.CYCLE_MAX_MOM, float, 0.9, s.ONE_CYCLE),
    (s.DECAY_MOM_RATE, float, 0.0, s.ONE_CYCLE),
    (s.WARMUP_MIN_LR, float, 0, "warmup"),
    (s.WARMUP_MAX_LR, float, 0.001, "warmup"),
    (s.WARMUP_NUM_STEPS, int, 1000, "warmup"),
    (s.WARMUP_TYPE, str, s.WARMUP_LOG_RATE, "warmup"),
]


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's "Convergence Tuning" flags (``--lr_schedule`` and each schedule's parameters)."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument(f"--{s.LR_SCHEDULE}", type=str, default=None, help="LR schedule for training.")
    for name, kind, default, schedule in _FLAGS:
        group.add_argument(f"--{name}", type=kind, default=default, help=f"{schedule} parameter {name}.")
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    """The tuning flags of ``sys.argv`` (unknown flags are returned, not rejected)."""
    return add_tuning_arguments(argparse.ArgumentParser()).parse_known_args()


def get_config_from_args(args: Any) -> tuple[dict[str, Any] | None, str | None]:
    """``({"type": ..., "params": {...}}, None)`` for ``--lr_schedule``, or ``(None, why)``."""
    schedule = getattr(args, s.LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{s.LR_SCHEDULE} not specified on command line"
    if schedule not in s.VALID_LR_SCHEDULES:
        return None, f"{schedule} is not supported LR schedule"
    family = schedule if schedule in (s.LR_RANGE_TEST, s.ONE_CYCLE) else "warmup"
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
    if schedule not in s.VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a valid LR schedule"
    if schedule == s.LR_RANGE_TEST:
        return params[s.LR_RANGE_TEST_MIN_LR], ""
    if schedule == s.ONE_CYCLE:
        return params[s.CYCLE_MAX_LR], ""
    return params[s.WARMUP_MAX_LR], ""
