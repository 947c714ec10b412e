"""``CurriculumScheduler``: the difficulty (e.g. sequence length) to train at, as a function of the global step.

Schedules, as DeepSpeed 0.19.8 computes them (``d_min``/``d_max`` = min/max_difficulty, ``T`` =
total_curriculum_step, ``s`` = difficulty_step):

- ``fixed_linear``: ``d = floor((step / T) * (d_max - d_min) + d_min)``, rounded down to a multiple of ``s``,
  at least the first multiple of ``s`` at or above ``d_min``, at most ``d_max``;
- ``fixed_root``: the same with ``(step / T) ** (1 / root_degree)``;
- ``fixed_discrete``: ``difficulty[i]`` for the first ``i`` with ``step <= max_step[i]``, the last difficulty
  after ``max_step[-1]``;
- ``custom``: a user function ``step -> difficulty`` given by ``set_custom_get_difficulty``.

The difficulty only moves while it is below ``max_difficulty`` (``update_difficulty``).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from deepspeed.runtime.data_pipeline import constants as C
from ds_config import ConfigError

logger = logging.getLogger(__name__)

SCHEDULE_TYPES = (C.CURRICULUM_LEARNING_SCHEDULE_FIXED_LINEAR, C.CURRICULUM_LEARNING_SCHEDULE_FIXED_ROOT,
                  C.CURRICULUM_LEARNING_SCHEDULE_FIXED_DISCRETE, C.CURRICULUM_LEARNING_SCHEDULE_CUSTOM)
_SCHEDULE_KEYS = {
    C.CURRICULUM_LEARNING_SCHEDULE_FIXED_LINEAR: ("total_curriculum_step", "difficulty_step"),
    C.CURRICULUM_LEARNING_SCHEDULE_FIXED_ROOT: ("total_curriculum_step", "difficulty_step", "root_degree"),
    C.CURRICULUM_LEARNING_SCHEDULE_FIXED_DISCRETE: ("difficulty", "max_step"),
    C.CURRICULUM_LEARNING_SCHEDULE_CUSTOM: (),
}


def as_plain_dict(config: Any) -> dict:
    """A config section as a plain dict: a mapping, or a typed (pydantic) section with unset keys left out."""
    if hasattr(config, "model_dump"):
        return config.model_dump(exclude_none=True)
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(f"expected a config dict or a typed config section, got {type(config).__name__}")


def fixed_root_value(global_steps: float, total_steps: int, root_degree: float, low: int, high: int,
                     multiple_of: int) -> int:
    """``floor((step / total) ** (1 / root_degree) * (high - low) + low)`` rounded down to a multiple of
    ``multiple_of`` and capped at ``high`` (DeepSpeed's shared pacing formula; no lower floor)."""
    fraction = (float(global_steps) / total_steps) ** (1.0 / root_degree)
    value = math.floor(fraction * (high - low) + low)
    value -= value % multiple_of
    return min(value, high)


def _check(config: dict, where: str) -> None:
    """Raise ``ConfigError`` naming the first missing or malformed key of a curriculum config."""
    for key in (C.CURRICULUM_LEARNING_MIN_DIFFICULTY, C.CURRICULUM_LEARNING_MAX_DIFFICULTY,
                C.CURRICULUM_LEARNING_SCHEDULE_TYPE):
        if key not in config:
            raise ConfigError(f"curriculum learning requires the config '{key}'", path=f"{where}.{key}")
    schedule_type = config[C.CURRICULUM_LEARNING_SCHEDULE_TYPE]
    if schedule_type not in SCHEDULE_TYPES:
        raise ConfigError(f"unsupported curriculum schedule_type {schedule_type!r}; use one of "
                          f"{', '.join(SCHEDULE_TYPES)}", path=f"{where}.schedule_type", value=schedule_type)
    needed = _SCHEDULE_KEYS[schedule_type]
    schedule = config.get(C.CURRICULUM_LEARNING_SCHEDULE_CONFIG) or {}
    for key in needed:
        if key not in schedule:
            raise ConfigError(f"curriculum schedule_type '{schedule_type}' requires the schedule_config "
                              f"'{key}' (it needs: {', '.join(needed)})", path=f"{where}.schedule_config.{key}")
    if schedule_type == C.CURRICULUM_LEARNING_SCHEDULE_FIXED_DISCRETE:
        difficulty, max_step = schedule["difficulty"], schedule["max_step"]
        if not difficulty or not max_step or len(difficulty) != len(max_step) + 1:
            raise ConfigError("fixed_discrete needs non-empty 'difficulty' and 'max_step' lists with one more "
                              f"difficulty than max_step (got {len(difficulty)} and {len(max_step)})",
                              path=f"{where}.schedule_config.max_step", value=max_step)
    elif "difficulty_step" in needed and schedule["difficulty_step"] % 8 != 0:
        logger.warning("When using seqlen metric, the difficulty_step for curriculum learning has to be multiple "
                       "of 8 (for FP16 data) or 16 (for INT8 data) to enable NVIDIA Tensor Core acceleration. "
                       "Disregard this warning if this is unrelated to your metric/hardware.")


class CurriculumScheduler:
    """Difficulty schedule of curriculum learning; ``config`` is a curriculum section (dict or typed config).

    ``where`` is the section's key path, used in error messages.
    """

    def __init__(self, config: Any, where: str = "curriculum_learning") -> None:
        config = as_plain_dict(config)
        _check(config, where)
        self.state: dict[str, Any] = {
            C.CURRICULUM_LEARNING_MIN_DIFFICULTY: config[C.CURRICULUM_LEARNING_MIN_DIFFICULTY],
            C.CURRICULUM_LEARNING_MAX_DIFFICULTY: config[C.CURRICULUM_LEARNING_MAX_DIFFICULTY],
            C.CURRICULUM_LEARNING_CURRENT_DIFFICULTY: config[C.CURRICULUM_LEARNING_MIN_DIFFICULTY],
            C.CURRICULUM_LEARNING_SCHEDULE_TYPE: config[C.CURRICULUM_LEARNING_SCHEDULE_TYPE],
        }
        if config[C.CURRICULUM_LEARNING_SCHEDULE_TYPE] != C.CURRICULUM_LEARNING_SCHEDULE_CUSTOM:
            self.state[C.CURRICULUM_LEARNING_SCHEDULE_CONFIG] = copy.deepcopy(
                config[C.CURRICULUM_LEARNING_SCHEDULE_CONFIG])
        self.custom_get_difficulty: Callable[[int], int] | None = None

    # -- current difficulty -------------------------------------------------------------------------------
    def get_current_difficulty(self) -> int:
        return self.state[C.CURRICULUM_LEARNING_CURRENT_DIFFICULTY]

    def set_current_difficulty(self, difficulty: int) -> None:
        self.state[C.CURRICULUM_LEARNING_CURRENT_DIFFICULTY] = difficulty

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        """Use ``schedule_function(global_steps) -> difficulty`` (the ``custom`` schedule type)."""
        self.custom_get_difficulty = schedule_function

    # -- schedules ----------------------------------------------------------------------------------------
    def _fixed_discrete(self, global_steps: int) -> int:
        schedule = self.state[C.CURRICULUM_LEARNING_SCHEDULE_CONFIG]
        difficulty, max_step = schedule["difficulty"], schedule["max_step"]
        for level, last_step in zip(difficulty, max_step, strict=False):
            if global_steps <= last_step:
                return level
        return difficulty[-1]

    def _fixed_root(self, global_steps: int, root_degree: float) -> int:
        schedule = self.state[C.CURRICULUM_LEARNING_SCHEDULE_CONFIG]
        low = self.state[C.CURRICULUM_LEARNING_MIN_DIFFICULTY]
        high = self.state[C.CURRICULUM_LEARNING_MAX_DIFFICULTY]
        step = schedule["difficulty_step"]
        value = fixed_root_value(global_steps, schedule["total_curriculum_step"], root_degree, low, high, step)
        # flooring to a multiple of the step can fall below min_difficulty (min 8, step 16 gives 0): raise it to
        # the first multiple of the step at or above min_difficulty, as DeepSpeed 0.19.8 does
        return min(max(value, -(-low // step) * step), high)

    def get_difficulty(self, global_steps: int) -> int:
        """The scheduled difficulty at ``global_steps`` (does not change the current difficulty)."""
        schedule_type = self.state[C.CURRICULUM_LEARNING_SCHEDULE_TYPE]
        if schedule_type == C.CURRICULUM_LEARNING_SCHEDULE_FIXED_DISCRETE:
            return self._fixed_discrete(global_steps)
        if schedule_type == C.CURRICULUM_LEARNING_SCHEDULE_FIXED_LINEAR:
            return self._fixed_root(global_steps, 1)
        if schedule_type == C.CURRICULUM_LEARNING_SCHEDULE_FIXED_ROOT:
            return self._fixed_root(global_steps, self.state[C.CURRICULUM_LEARNING_SCHEDULE_CONFIG]["root_degree"])
        if self.custom_get_difficulty is None:
            raise RuntimeError("curriculum schedule_type 'custom' needs a schedule function: call "
                               "set_custom_get_difficulty(fn) (engine: set_custom_curriculum_learning_schedule)")
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> int:
        """Move the current difficulty to the schedule's value at ``global_steps`` unless it reached the max."""
        if self.state[C.CURRICULUM_LEARNING_CURRENT_DIFFICULTY] < self.state[C.CURRICULUM_LEARNING_MAX_DIFFICULTY]:
            self.state[C.CURRICULUM_LEARNING_CURRENT_DIFFICULTY] = self.get_difficulty(global_steps)
        return self.state[C.CURRICULUM_LEARNING_CURRENT_DIFFICULTY]

    # -- checkpointing ------------------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        """A copy of the scheduler's state (the custom function is not part of it)."""
        return copy.deepcopy(self.state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.state = copy.deepcopy(dict(state_dict))
