"""``RandomLTDScheduler``: how many tokens random-LTD layers keep, as a function of the global step.

``fixed_linear`` (the one schedule DeepSpeed supports): ``floor((step / require_steps) * (max - min) + min)``,
rounded down to a multiple of ``seq_per_step`` and capped at ``max_value``. The scheduler also counts the
layer-tokens consumed: per step ``global_batch_size * (kept * random_ltd_layer_num + max_value * other_layers)``.
"""

from __future__ import annotations

from typing import Any

from deepspeed.runtime.data_pipeline import constants as C
from deepspeed.runtime.data_pipeline.curriculum_scheduler import as_plain_dict, fixed_root_value
from ds_config import ConfigError

_WHERE = "data_efficiency.data_routing.random_ltd"


def _require(config: dict, keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        if config.get(key) is None:
            raise ConfigError(f"random-LTD requires the config '{key}'", path=f"{where}.{key}")


class BaseScheduler:
    """The value schedule shared by random-LTD schedulers; ``state`` holds min/max/current and the config."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def get_value(self, global_steps: int) -> int:
        if self.state[C.RANDOM_LTD_SCHEDULER_TYPE] != "fixed_linear":
            raise ConfigError(f"unsupported random-LTD schedule_type {self.state[C.RANDOM_LTD_SCHEDULER_TYPE]!r}; "
                              "only 'fixed_linear' exists", path=f"{_WHERE}.random_ltd_schedule.schedule_type")
        schedule = self.state[C.RANDOM_LTD_SCHEDULE_CONFIG]
        return fixed_root_value(global_steps, schedule[C.RANDOM_LTD_REQUIRE_STEP], 1,
                                self.state[C.RANDOM_LTD_MIN_VALUE], self.state[C.RANDOM_LTD_MAX_VALUE],
                                schedule[C.RANDOM_LTD_INCREASE_STEP])


class RandomLTDScheduler(BaseScheduler):
    """Token-count schedule of random-LTD; ``config`` is the ``random_ltd`` section (dict or typed config) with
    ``global_batch_size`` and ``micro_batch_size`` filled in by the engine."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        config = as_plain_dict(config)
        _require(config, (C.RANDOM_LTD_TOTAL_LAYER_NUM, C.RANDOM_LTD_LAYER_NUM, C.RANDOM_LTD_SCHEDULER,
                          C.RANDOM_LTD_GLOBAL_BATCH_SIZE), _WHERE)
        schedule = dict(config[C.RANDOM_LTD_SCHEDULER])  # a copy: the defaults below stay out of the caller's dict
        where = f"{_WHERE}.{C.RANDOM_LTD_SCHEDULER}"
        _require(schedule, (C.RANDOM_LTD_MIN_VALUE, C.RANDOM_LTD_MAX_VALUE, C.RANDOM_LTD_SCHEDULE_CONFIG), where)
        _require(schedule[C.RANDOM_LTD_SCHEDULE_CONFIG], (C.RANDOM_LTD_REQUIRE_STEP, C.RANDOM_LTD_INCREASE_STEP),
                 f"{where}.{C.RANDOM_LTD_SCHEDULE_CONFIG}")
        schedule.setdefault(C.RANDOM_LTD_SCHEDULER_TYPE, "fixed_linear")
        self.model_layer_num = config[C.RANDOM_LTD_TOTAL_LAYER_NUM]
        self.random_ltd_layer_num = config[C.RANDOM_LTD_LAYER_NUM]
        self.config_schedule = schedule
        self.global_batch_size = config[C.RANDOM_LTD_GLOBAL_BATCH_SIZE]
        if (config.get(C.RANDOM_LTD_LAYER_TOKEN_LR_SCHEDULE) or {}).get(C.RANDOM_LTD_LAYER_TOKEN_LR_ENABLED):
            raise ValueError("random_ltd.layer_token_lr_schedule.enabled=True: the layer-token LR schedule is "
                             "unfinished in DeepSpeed too; accepted: false")
        self.reset_to_init()

    def reset_to_init(self) -> None:
        schedule = self.config_schedule
        self.state[C.RANDOM_LTD_MIN_VALUE] = schedule[C.RANDOM_LTD_MIN_VALUE]
        self.state[C.RANDOM_LTD_MAX_VALUE] = schedule[C.RANDOM_LTD_MAX_VALUE]
        self.state[C.RANDOM_LTD_CURRENT_VALUE] = schedule[C.RANDOM_LTD_MIN_VALUE]
        self.state[C.RANDOM_LTD_SCHEDULE_CONFIG] = dict(schedule[C.RANDOM_LTD_SCHEDULE_CONFIG])
        self.state[C.RANDOM_LTD_SCHEDULER_TYPE] = schedule[C.RANDOM_LTD_SCHEDULER_TYPE]
        self.state[C.RANDOM_LTD_CONSUMED_LAYER_TOKENS] = 0
        self.state[C.RANDOM_LTD_CURR_STEP] = -1

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """Layer-tokens consumed after stepping the schedule through ``train_iters`` steps (advances the state)."""
        for step in range(train_iters):
            self.update_seq(step)
        return self.state[C.RANDOM_LTD_CONSUMED_LAYER_TOKENS]

    def get_current_seq(self) -> int:
        """Tokens each random-LTD layer keeps now."""
        return self.state[C.RANDOM_LTD_CURRENT_VALUE]

    def set_current_seq(self, seq_length: int) -> None:
        self.state[C.RANDOM_LTD_CURRENT_VALUE] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def update_seq(self, global_steps: int) -> None:
        """Advance the kept-token count to ``global_steps`` and count the step's layer-tokens once."""
        if self.state[C.RANDOM_LTD_CURRENT_VALUE] < self.state[C.RANDOM_LTD_MAX_VALUE]:
            self.state[C.RANDOM_LTD_CURRENT_VALUE] = self.get_value(global_steps)
        if global_steps != self.state[C.RANDOM_LTD_CURR_STEP]:
            kept = self.state[C.RANDOM_LTD_CURRENT_VALUE] * self.random_ltd_layer_num
            full = self.state[C.RANDOM_LTD_MAX_VALUE] * (self.model_layer_num - self.random_ltd_layer_num)
            self.state[C.RANDOM_LTD_CONSUMED_LAYER_TOKENS] += self.global_batch_size * (kept + full)
            self.state[C.RANDOM_LTD_CURR_STEP] = global_steps

    _SAVED = (C.RANDOM_LTD_CONSUMED_LAYER_TOKENS, C.RANDOM_LTD_CURR_STEP, C.RANDOM_LTD_CURRENT_VALUE,
              C.RANDOM_LTD_MIN_VALUE, C.RANDOM_LTD_MAX_VALUE)

    def state_dict(self) -> dict[str, Any]:
        return {key: self.state[key] for key in self._SAVED}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in self._SAVED:
            self.state[key] = state_dict[key]
