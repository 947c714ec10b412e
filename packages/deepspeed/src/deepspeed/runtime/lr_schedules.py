"""DeepSpeed's learning-rate schedules: LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR.

A schedule is stepped once per training batch, after the optimizer step. Its position is
``last_batch_iteration`` (-1 before the first ``step()``); every learning rate (and OneCycle's momentum) is a
pure function of that position, so ``state_dict()`` is just the position (plus base rates read from the
optimizer) and a resumed run reproduces the uninterrupted one exactly. ``build_lr_scheduler`` turns the
typed ``scheduler`` config section into a schedule.
"""

from __future__ import annotations

import abc
import math
import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from deepspeed.runtime.lr_schedule_cli import (
    add_tuning_arguments,
    get_config_from_args,
    get_lr_from_config,
    parse_arguments,
)
from deepspeed.runtime.lr_schedule_keys import (
    COS_MIN_RATIO,
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
    EDGE_VALUE,
    LAST_BATCH_ITERATION,
    LR_RANGE_TEST,
    LR_RANGE_TEST_MIN_LR,
    LR_RANGE_TEST_STAIRCASE,
    LR_RANGE_TEST_STEP_RATE,
    LR_RANGE_TEST_STEP_SIZE,
    LR_SCHEDULE,
    MID_VALUE,
    ONE_CYCLE,
    TOTAL_NUM_STEPS,
    VALID_LR_SCHEDULES,
    WARMUP_COSINE_LR,
    WARMUP_DECAY_LR,
    WARMUP_LINEAR_RATE,
    WARMUP_LOG_RATE,
    WARMUP_LR,
    WARMUP_MAX_LR,
    WARMUP_MIN_LR,
    WARMUP_MIN_RATIO,
    WARMUP_NUM_STEPS,
    WARMUP_TYPE,
    WARMUP_TYPES,
)
from ds_config import ConfigError, ConfigProblem

__all__ = [
    "COS_MIN_RATIO", "CYCLE_FIRST_STAIR_COUNT", "CYCLE_FIRST_STEP_SIZE", "CYCLE_MAX_LR", "CYCLE_MAX_MOM",
    "CYCLE_MIN_LR", "CYCLE_MIN_MOM", "CYCLE_SECOND_STAIR_COUNT", "CYCLE_SECOND_STEP_SIZE", "DECAY_LR_RATE",
    "DECAY_MOM_RATE", "DECAY_STEP_SIZE", "EDGE_VALUE", "LAST_BATCH_ITERATION", "LRRangeTest", "LR_RANGE_TEST",
    "LR_RANGE_TEST_MIN_LR", "LR_RANGE_TEST_STAIRCASE", "LR_RANGE_TEST_STEP_RATE", "LR_RANGE_TEST_STEP_SIZE",
    "LR_SCHEDULE", "MID_VALUE", "ONE_CYCLE", "OneCycle", "TOTAL_NUM_STEPS", "VALID_LR_SCHEDULES",
    "WARMUP_COSINE_LR", "WARMUP_DECAY_LR", "WARMUP_LINEAR_RATE", "WARMUP_LOG_RATE", "WARMUP_LR", "WARMUP_MAX_LR",
    "WARMUP_MIN_LR", "WARMUP_MIN_RATIO", "WARMUP_NUM_STEPS", "WARMUP_TYPE", "WARMUP_TYPES", "WarmupCosineLR",
    "WarmupDecayLR", "WarmupLR", "add_tuning_arguments", "build_lr_scheduler", "get_config_from_args",
    "get_lr_from_config", "get_torch_optimizer", "parse_arguments", "update_lr",
]


# ----------------------------------------------------------------------------------------------------------
# argument checks: every error names the argument, the value and what is accepted


def _bad(name: str, value: Any, accepted: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid; accepted: {accepted}")


def _number(value: Any, name: str, accepted: str = "a finite number") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise _bad(name, value, accepted)
    return float(value)


def _at_least(value: Any, name: str, low: float, accepted: str) -> float:
    number = _number(value, name, accepted)
    if number < low:
        raise _bad(name, value, accepted)
    return number


def _int(value: Any, name: str, low: int) -> int:
    accepted = f"an integer >= {low}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise _bad(name, value, accepted)
    return int(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, value, "True or False")
    return value


def _warmup_type(value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise _bad(WARMUP_TYPE, value, " or ".join(repr(t) for t in WARMUP_TYPES))
    return value


def _per_group(value: Any, name: str, n_groups: int, low: float = 0.0) -> list[float]:
    """A scalar for every parameter group, or one value per group; each >= ``low``."""
    accepted = f"a number >= {low:g}, or a list of {n_groups} such numbers (one per parameter group)"
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise _bad(name, value, accepted)
        values = list(value)
    else:
        values = [value] * n_groups
    return [_at_least(v, name, low, accepted) for v in values]


def _ordered(low: list[float], high: list[float], low_name: str, high_name: str) -> None:
    for lo, hi in zip(low, high, strict=True):
        if lo > hi:
            raise ValueError(f"{low_name}={lo!r} is above {high_name}={hi!r}; accepted: {low_name} <= {high_name}")


def get_torch_optimizer(optimizer: Any) -> Any:
    """The object whose ``param_groups`` a schedule drives: a torch optimizer, or the one a wrapper holds.

    Wrappers (fp16/ZeRO optimizers) expose the wrapped torch optimizer as ``.optimizer``.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    if isinstance(getattr(optimizer, "param_groups", None), list):
        return optimizer
    raise TypeError(f"optimizer={type(optimizer).__name__} is invalid; accepted: a torch.optim.Optimizer, a "
                    "wrapper holding one as .optimizer, or an object with a param_groups list")


def update_lr(param_groups: Sequence[dict], lrs: Sequence[float]) -> list[Any]:
    """Write ``lrs`` into the parameter groups; returns the rates now in the groups.

    A group whose learning rate is a tensor keeps that very tensor, as in DeepSpeed: the new rate is written into
    it in place (its shape, dtype and device stay; whoever holds it, a compiled step or a capturing graph,
    sees the new rate).
    """
    for group, lr in zip(param_groups, lrs, strict=False):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


# ----------------------------------------------------------------------------------------------------------
# schedules


class _Schedule(abc.ABC):
    """Position tracking, optimizer updates and save/restore shared by every schedule."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = get_torch_optimizer(optimizer)
        self.last_batch_iteration = _int(last_batch_iteration, LAST_BATCH_ITERATION, -1)
        # The optimizer's own rates before the schedule touches them: the reference of ratio schedules.
        self.base_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self._uses_base_lrs = False
        self._last_lr: list[float] = []

    @abc.abstractmethod
    def _lrs_at(self, iteration: int) -> list[float]:
        """Learning rate of every parameter group after step ``iteration`` (-1: before the first step)."""

    def get_lr(self) -> list[float]:
        """The learning rates the schedule prescribes at ``last_batch_iteration``, one per parameter group."""
        return self._lrs_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The learning rates last written into the optimizer."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one batch (or jump to ``last_batch_iteration``) and update the optimizer."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = _int(last_batch_iteration, LAST_BATCH_ITERATION, -1)
        self._apply()

    def _apply(self) -> None:
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def state_dict(self) -> dict[str, Any]:
        """The schedule's position (DeepSpeed's checkpoint key), plus base rates where the schedule uses them."""
        state: dict[str, Any] = {LAST_BATCH_ITERATION: self.last_batch_iteration}
        if self._uses_base_lrs:
            state["base_lrs"] = list(self.base_lrs)
        return state

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume at the saved position and write its rates into the optimizer."""
        if LAST_BATCH_ITERATION not in sd:
            raise ValueError(f"state_dict keys {sorted(sd)} are invalid; accepted: a dict with "
                             f"'{LAST_BATCH_ITERATION}' (from {type(self).__name__}.state_dict())")
        self.last_batch_iteration = _int(sd[LAST_BATCH_ITERATION], LAST_BATCH_ITERATION, -1)
        if self._uses_base_lrs and "base_lrs" in sd:
            self._set_base_lrs(_per_group(list(sd["base_lrs"]), "base_lrs", len(self.optimizer.param_groups)))
        self._apply()

    def _set_base_lrs(self, lrs: list[float]) -> None:
        self.base_lrs = lrs


class LRRangeTest(_Schedule):
    """Learning-rate range test: ``lr = min_lr * (1 + step_rate * interval)`` with
    ``interval = (last_batch_iteration + 1) / step_size`` (floored when ``lr_range_test_staircase``).

    Used to find the largest learning rate that still trains, e.g. to set OneCycle's bounds.
    """

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float | list[float] = 0.001,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        n_groups = len(self.optimizer.param_groups)
        self.min_lr = _per_group(lr_range_test_min_lr, LR_RANGE_TEST_MIN_LR, n_groups)
        if any(lr == 0 for lr in self.min_lr):  # a multiplicative test from 0 never leaves 0
            raise _bad(LR_RANGE_TEST_MIN_LR, lr_range_test_min_lr, "learning rates > 0")
        self.step_size = _int(lr_range_test_step_size, LR_RANGE_TEST_STEP_SIZE, 1)
        self.step_rate = _at_least(lr_range_test_step_rate, LR_RANGE_TEST_STEP_RATE, 0.0, "a number >= 0")
        self.staircase = _bool(lr_range_test_staircase, LR_RANGE_TEST_STAIRCASE)
        self._apply()

    def _interval(self, iteration: int) -> float:
        batches = iteration + 1
        return float(batches // self.step_size) if self.staircase else batches / self.step_size

    def _lrs_at(self, iteration: int) -> list[float]:
        increase = 1.0 + self.step_rate * self._interval(iteration)
        return [lr * increase for lr in self.min_lr]


class OneCycle(_Schedule):
    """1Cycle: the learning rate rises from ``cycle_min_lr`` to ``cycle_max_lr`` over ``cycle_first_step_size``
    batches and falls back over ``cycle_second_step_size``, then decays as
    ``cycle_min_lr / (1 + decay_lr_rate * n / decay_step_size)`` after ``n`` further batches.

    Momentum moves inversely (``cycle_max_mom`` -> ``cycle_min_mom`` -> ``cycle_max_mom``), then grows as
    ``cycle_max_mom * (1 + decay_mom_rate * n / decay_step_size)``. It is written to a group's first beta
    (Adam-style ``betas``, keeping the group's second beta) or to its ``momentum`` (SGD-style). A stair count
    ``k > 0`` makes that half of the cycle move in ``k`` equal stairs instead of continuously, as DeepSpeed's:
    the rising half counts stairs from its start, the falling half from the cycle's end.
    ``cycle_second_step_size=0`` is a cycle without a falling half: the rate rises for
    ``cycle_first_step_size`` batches and the cycle's last batch is back at ``cycle_min_lr`` (DeepSpeed's
    phase wraps there), as DeepSpeed does.
    """

    def __init__(self, optimizer: Any, cycle_min_lr: float | list[float], cycle_max_lr: float | list[float],
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float | list[float] = 0.8,
                 cycle_max_mom: float | list[float] = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        n_groups = len(self.optimizer.param_groups)
        self.first_step_size = _int(cycle_first_step_size, CYCLE_FIRST_STEP_SIZE, 1)
        second = self.first_step_size if cycle_second_step_size is None else cycle_second_step_size
        self.second_step_size = _int(second, CYCLE_SECOND_STEP_SIZE, 0)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = _int(cycle_first_stair_count, CYCLE_FIRST_STAIR_COUNT, 0)
        stairs = self.first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.second_stair_count = _int(stairs, CYCLE_SECOND_STAIR_COUNT, 0)
        self.decay_step_size = _int(decay_step_size, DECAY_STEP_SIZE, 0)

        self.min_lrs = _per_group(cycle_min_lr, CYCLE_MIN_LR, n_groups)
        self.max_lrs = _per_group(cycle_max_lr, CYCLE_MAX_LR, n_groups)
        _ordered(self.min_lrs, self.max_lrs, CYCLE_MIN_LR, CYCLE_MAX_LR)
        self.decay_lr_rate = _at_least(decay_lr_rate, DECAY_LR_RATE, 0.0, "a number >= 0")

        self.cycle_momentum = _bool(cycle_momentum, "cycle_momentum")
        self.min_moms = _per_group(cycle_min_mom, CYCLE_MIN_MOM, n_groups)
        self.max_moms = _per_group(cycle_max_mom, CYCLE_MAX_MOM, n_groups)
        _ordered(self.min_moms, self.max_moms, CYCLE_MIN_MOM, CYCLE_MAX_MOM)
        self.decay_mom_rate = _number(decay_mom_rate, DECAY_MOM_RATE)
        if self.cycle_momentum and not all(_momentum_key(g) for g in self.optimizer.param_groups):
            warnings.warn(f"OneCycle: cycle_momentum is disabled because {type(self.optimizer).__name__} has "
                          "neither 'betas' nor 'momentum' in its parameter groups", stacklevel=2)
            self.cycle_momentum = False
        self.skip_lr_decay = self.decay_step_size == 0 or self.decay_lr_rate == 0
        self.skip_mom_decay = self.decay_step_size == 0 or self.decay_mom_rate == 0
        self._apply()
        if self.cycle_momentum and self.last_batch_iteration == -1:
            # as DeepSpeed's constructor: the groups hold cycle_min_mom until the first step (get_mom() already
            # reports the schedule's cycle_max_mom there), so the first optimizer step uses DeepSpeed's momentum
            self._write_moms([(mom, *tuple(group["betas"])[1:]) if _momentum_key(group) == "betas" else mom
                              for group, mom in zip(self.optimizer.param_groups, self.min_moms, strict=True)])

    def _scale_factor(self, iteration: int) -> float:
        """Position in the cycle's amplitude, 0 (at the min lr) .. 1 (at the max lr)."""
        batches = iteration + 1
        if batches >= self.total_size:  # the cycle's end: DeepSpeed's phase wraps back to 0
            return 0.0
        if batches <= self.first_step_size:
            return _stairs(batches, self.first_step_size, self.first_stair_count)
        return _stairs(self.total_size - batches, self.second_step_size, self.second_stair_count)

    def _decay_interval(self, iteration: int) -> float:
        return (iteration - self.total_size + 1) / self.decay_step_size

    def _lrs_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale_factor(iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_interval(iteration)
        return [lo / factor for lo in self.min_lrs]

    def _moms_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale_factor(iteration)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms, strict=True)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_interval(iteration)
        return [hi * factor for hi in self.max_moms]

    def get_mom(self) -> list[tuple | float] | None:
        """Momentum of every group at ``last_batch_iteration``, ``None`` when not cycled: for an Adam-style
        group the ``betas`` pair ``(beta1, beta2)`` DeepSpeed returns (beta1 cycled, the group's beta2), for an
        SGD-style group its ``momentum``."""
        if not self.cycle_momentum:
            return None
        moms = self._moms_at(self.last_batch_iteration)
        return [(mom, *tuple(group["betas"])[1:]) if _momentum_key(group) == "betas" else mom
                for group, mom in zip(self.optimizer.param_groups, moms, strict=True)]

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            self._write_moms(self.get_mom())

    def _write_moms(self, moms: list[tuple | float]) -> None:
        for group, momentum in zip(self.optimizer.param_groups, moms, strict=False):
            group[_momentum_key(group)] = momentum


def _momentum_key(group: dict) -> str | None:
    return "betas" if "betas" in group else "momentum" if "momentum" in group else None


def _stairs(done: int, size: int, stair_count: int) -> float:
    """Fraction ``done / size`` of a half cycle, quantised down to ``stair_count`` stairs when > 0
    (``size`` > 0: callers reach here only inside a half of non-zero length)."""
    if stair_count == 0:
        return done / size
    return (done * stair_count // size) / stair_count


def _warmup_fraction(warmup_type: str, iteration: int, num_steps: int) -> float:
    """0 at the first batch, rising towards 1 at ``num_steps``: ``log(i + 1) / log(n)`` or ``i / n``."""
    if iteration < 0:
        return 0.0
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(iteration + 1) / math.log(num_steps)
    return iteration / num_steps


class WarmupLR(_Schedule):
    """Warm the learning rate up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``
    batches (``log`` or ``linear`` curve), then hold it. ``warmup_max_lr=None`` uses the optimizer's rates.
    """

    def __init__(self, optimizer: Any, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        n_groups = len(self.optimizer.param_groups)
        self.min_lrs = _per_group(warmup_min_lr, WARMUP_MIN_LR, n_groups)
        self._uses_base_lrs = warmup_max_lr is None
        max_lrs = self.base_lrs if warmup_max_lr is None else warmup_max_lr
        self._set_max_lrs(_per_group(max_lrs, WARMUP_MAX_LR, n_groups))
        # DeepSpeed rejects warmup_num_steps <= 0 (ValueError); log(1) = 0 cannot normalise the log curve,
        # hence at least 2 warm-up steps (as DeepSpeed).
        self.warmup_num_steps = max(2, _int(warmup_num_steps, WARMUP_NUM_STEPS, 1))
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self._check_total_steps()
        self._apply()

    def _set_max_lrs(self, max_lrs: list[float]) -> None:
        _ordered(self.min_lrs, max_lrs, WARMUP_MIN_LR, WARMUP_MAX_LR)
        self.max_lrs = max_lrs
        self.delta_lrs = [hi - lo for lo, hi in zip(self.min_lrs, max_lrs, strict=True)]

    def _set_base_lrs(self, lrs: list[float]) -> None:
        super()._set_base_lrs(lrs)
        self._set_max_lrs(lrs)

    def _check_total_steps(self) -> None:
        """Hook for schedules with a total length."""

    def _get_gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, iteration, self.warmup_num_steps)
        return 1.0

    def _lrs_at(self, iteration: int) -> list[float]:
        gamma = self._get_gamma(iteration)
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay from ``warmup_max_lr`` to 0 at ``total_num_steps``:
    ``lr = max_lr * (total_num_steps - i) / (total_num_steps - warmup_num_steps)``.
    """

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _int(total_num_steps, TOTAL_NUM_STEPS, 1)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _check_total_steps(self) -> None:
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"{type(self).__name__}: total_num_steps={self.total_num_steps} is less than "
                          f"warmup_num_steps={self.warmup_num_steps}", stacklevel=3)

    def _get_gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, iteration, self.warmup_num_steps)
        remaining = self.total_num_steps - iteration
        return max(0.0, remaining / max(1, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """Scale the optimizer's own learning rates: warm up from ``warmup_min_ratio`` to 1 over
    ``warmup_num_steps`` batches, then follow a half cosine down to ``cos_min_ratio`` at ``total_num_steps``
    and stay there. Before the first ``step()`` the ratio is 0 (DeepSpeed's), so a fresh schedule sets the
    rates to 0.
    """

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self._uses_base_lrs = True
        self.total_num_steps = _int(total_num_steps, TOTAL_NUM_STEPS, 1)
        self.warmup_min_ratio = _ratio(warmup_min_ratio, WARMUP_MIN_RATIO)
        self.cos_min_ratio = _ratio(cos_min_ratio, COS_MIN_RATIO)
        self.warmup_num_steps = max(2, _int(warmup_num_steps, WARMUP_NUM_STEPS, 1))
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"WarmupCosineLR: total_num_steps={self.total_num_steps} is less than "
                          f"warmup_num_steps={self.warmup_num_steps}", stacklevel=2)
        self._apply()

    @property
    def org_lrs(self) -> list[float]:
        """The optimizer's learning rates the ratios multiply (DeepSpeed's name)."""
        return self.base_lrs

    def _ratio_at(self, iteration: int) -> float:
        if iteration < 0:  # before the first step DeepSpeed's ratio is 0, not warmup_min_ratio
            return 0.0
        if iteration < self.warmup_num_steps:
            rise = _warmup_fraction(self.warmup_type, iteration, self.warmup_num_steps)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * rise
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped at the end: past total_num_steps the rate stays at cos_min_ratio instead of rising again.
        done = min(iteration - self.warmup_num_steps + 1, decay_steps)
        cosine = (1.0 + math.cos(math.pi * done / decay_steps)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr_ratio(self) -> float:
        """The factor applied to every group's base learning rate at ``last_batch_iteration``."""
        return self._ratio_at(self.last_batch_iteration)

    def _lrs_at(self, iteration: int) -> list[float]:
        ratio = self._ratio_at(iteration)
        return [lr * ratio for lr in self.base_lrs]


def _ratio(value: Any, name: str) -> float:
    ratio = _at_least(value, name, 0.0, "a ratio in [0, 1]")
    if ratio > 1.0:
        raise _bad(name, value, "a ratio in [0, 1]")
    return ratio


# ----------------------------------------------------------------------------------------------------------
# the ``scheduler`` config section


_SCHEDULES: dict[str, type[_Schedule]] = {
    LR_RANGE_TEST: LRRangeTest, ONE_CYCLE: OneCycle, WARMUP_LR: WarmupLR, WARMUP_DECAY_LR: WarmupDecayLR,
    WARMUP_COSINE_LR: WarmupCosineLR,
}


def _torch_schedules() -> dict[str, type]:
    """``torch.optim.lr_scheduler`` classes a config may name (DeepSpeed falls back to them too)."""
    module = torch.optim.lr_scheduler
    bases = (module.LRScheduler, module.ReduceLROnPlateau)
    return {name: obj for name, obj in vars(module).items()
            if isinstance(obj, type) and issubclass(obj, bases) and obj not in bases and not name.startswith("_")}


def _schedule_class(name: str) -> type:
    if name in _SCHEDULES:
        return _SCHEDULES[name]
    torch_classes = _torch_schedules()
    if name in torch_classes:
        return torch_classes[name]
    accepted = (f"{', '.join(VALID_LR_SCHEDULES)}, or a torch.optim.lr_scheduler class "
                f"({', '.join(sorted(torch_classes))})")
    raise ConfigError(ConfigProblem("scheduler.type", f"unknown learning-rate schedule; accepted: {accepted}", name))


def build_lr_scheduler(section: Any, optimizer: Any) -> Any:
    """Build the schedule a typed ``scheduler`` section (``DeepSpeedConfig.scheduler``) describes.

    DeepSpeed's five schedules come from this module, any other ``type`` from ``torch.optim.lr_scheduler``;
    returns ``None`` when there is no section. Values still ``"auto"`` (for Hugging Face to fill in) and
    parameters the schedule rejects raise ``ConfigError`` naming the ``scheduler.*`` key.
    """
    if section is None:
        return None
    params = section.constructor_params()
    auto = [ConfigProblem(f"scheduler.params.{key}", 'is still "auto"; fill it in (the Hugging Face integration '
                          "does) before the schedule is built", value)
            for key, value in params.items() if isinstance(value, str) and value == "auto"]
    if auto:
        raise ConfigError(auto)
    schedule_class = _schedule_class(section.type)
    torch_optimizer = get_torch_optimizer(optimizer)  # outside the try: a bad optimizer is not a config error
    try:
        return schedule_class(torch_optimizer, **params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(ConfigProblem("scheduler.params", f"{section.type}: {exc}")) from exc
