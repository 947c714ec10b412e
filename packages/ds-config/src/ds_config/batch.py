"""Batch-size arithmetic: ``train_batch_size = micro_batch_per_gpu * gradient_accumulation_steps * dp_world``.

Given any two of the three keys (or ``train_batch_size`` or the micro batch alone) and the data-parallel world
size, derive the rest the way DeepSpeed does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_config._errors import ConfigError, ConfigProblem

TBS, MBS, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """The resolved batch numbers for one data-parallel world size (all in samples / steps)."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int

    def as_dict(self) -> dict[str, int]:
        return {TBS: self.train_batch_size, MBS: self.train_micro_batch_size_per_gpu,
                GAS: self.gradient_accumulation_steps}


_AUTO_HINT = ("is still \"auto\": the Hugging Face Trainer/Accelerate integration fills it in from its own "
              "arguments; to derive the batch sizes yourself, write a number here (any two of train_batch_size, "
              "train_micro_batch_size_per_gpu, gradient_accumulation_steps are enough)")


def _check_given(given: dict[str, Any]) -> None:
    """Every given batch key is a positive integer; all offenders (``"auto"`` ones first) in one error."""
    autos = [name for name, value in given.items() if value == "auto"]
    problems = [ConfigProblem(name, _AUTO_HINT if i == 0 else "is still \"auto\" as well")
                for i, name in enumerate(autos)]
    problems += [ConfigProblem(name, "must be a positive integer", value) for name, value in given.items()
                 if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value <= 0)]
    if problems:
        raise ConfigError(problems)


def _equation(tbs: int, mbs: int, gas: int, ws: int) -> str:
    return (f"train_batch_size ({tbs}) must equal train_micro_batch_size_per_gpu ({mbs}) * "
            f"gradient_accumulation_steps ({gas}) * data-parallel world size ({ws}) = {mbs * gas * ws}")


def resolve_batch_sizes(train_batch_size: int | None = None, train_micro_batch_size_per_gpu: int | None = None,
                        gradient_accumulation_steps: int | None = None, *, world_size: int) -> BatchSizes:
    """Derive the missing batch keys for ``world_size`` data-parallel ranks; check consistency.

    Raises ``ConfigError`` when fewer than the required keys are given, a value is not a positive integer (or
    still ``"auto"``), or the numbers do not satisfy the equation (the message shows it with the numbers).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ConfigError(ConfigProblem("world_size", "must be a positive integer", world_size))
    tbs, mbs, gas = train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps
    _check_given({name: value for name, value in ((TBS, tbs), (MBS, mbs), (GAS, gas)) if value is not None})
    if tbs is None and mbs is None:
        raise ConfigError(ConfigProblem(TBS, "either train_batch_size or train_micro_batch_size_per_gpu "
                                             "must be given"))
    if tbs is not None and mbs is not None:
        if gas is None:  # with all three given there is nothing to derive; the equation below checks them
            gas = _divide(tbs, mbs * world_size, GAS, f"train_batch_size ({tbs}) / (train_micro_batch_size_per_gpu "
                                                        f"({mbs}) * world size ({world_size}))")
    elif tbs is not None and gas is not None:
        mbs = _divide(tbs, gas * world_size, MBS, f"train_batch_size ({tbs}) / (gradient_accumulation_steps "
                                                    f"({gas}) * world size ({world_size}))")
    elif mbs is not None:
        gas = 1 if gas is None else gas
        tbs = mbs * gas * world_size
    else:
        gas = 1
        mbs = _divide(tbs, world_size, MBS, f"train_batch_size ({tbs}) / world size ({world_size})")
    if tbs != mbs * gas * world_size:
        raise ConfigError(ConfigProblem(TBS, _equation(tbs, mbs, gas, world_size)))
    return BatchSizes(tbs, mbs, gas, world_size)


def _divide(numerator: int, denominator: int, derived: str, formula: str) -> int:
    if numerator % denominator:
        raise ConfigError(ConfigProblem(derived, f"cannot be derived: {formula} = {numerator / denominator:g} "
                                                 "is not a whole number"))
    return numerator // denominator
