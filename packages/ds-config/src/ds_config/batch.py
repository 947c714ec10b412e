"""Batch-size arithmetic: ``train_batch_size = micro_batch_per_gpu * gradient_accumulation_steps * dp_world``.

Given any two of the three keys (or ``train_batch_size`` or the micro batch alone) and the data-parallel world
size, derive the rest the way DeepSpeed does. Before the world size is known, ``implied_world_sizes`` says which
world sizes the given keys fit, and rejects keys that fit none (``train_batch_size`` 30 with micro batch 4 and 2
accumulation steps) with the nearest consistent values.
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
    still ``"auto"``), or the numbers do not satisfy the equation (the message shows it with the numbers and
    says which world sizes the given keys would fit).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ConfigError(ConfigProblem("world_size", "must be a positive integer", world_size))
    tbs, mbs, gas = train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps
    _check_present(tbs, mbs, gas)
    try:
        return _resolve(tbs, mbs, gas, world_size)
    except ConfigError as exc:
        problem = exc.problems[0]
        raise ConfigError(ConfigProblem(problem.path, problem.message + _fit_note(tbs, mbs, gas))) from None


def _check_present(tbs: Any, mbs: Any, gas: Any) -> None:
    _check_given({name: value for name, value in ((TBS, tbs), (MBS, mbs), (GAS, gas)) if value is not None})
    if tbs is None and mbs is None:
        raise ConfigError(ConfigProblem(TBS, "either train_batch_size or train_micro_batch_size_per_gpu "
                                             "must be given"))


def _resolve(tbs: int | None, mbs: int | None, gas: int | None, world_size: int) -> BatchSizes:
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


# ------------------------------------------------------------------------- before the world size is known
def implied_world_sizes(train_batch_size: int | None = None, train_micro_batch_size_per_gpu: int | None = None,
                        gradient_accumulation_steps: int | None = None) -> tuple[int, ...] | None:
    """Every data-parallel world size for which ``resolve_batch_sizes`` accepts these keys, smallest first.

    ``None`` when ``train_batch_size`` is not given: it then follows from the world size, so every world size
    fits. Raises ``ConfigError`` (naming the keys and the nearest consistent values) when no world size fits,
    and for the same bad inputs as ``resolve_batch_sizes``.
    """
    tbs, mbs, gas = train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps
    _check_present(tbs, mbs, gas)
    sizes = _fits(tbs, mbs, gas)
    if sizes == ():
        raise ConfigError(ConfigProblem(TBS, f"{_no_fit(tbs, mbs, gas)}; {_nearest(tbs, mbs, gas)}"))
    return sizes


def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(sorted({*small, *(n // d for d in small)}))


def _fits(tbs: int | None, mbs: int | None, gas: int | None) -> tuple[int, ...] | None:
    """The world sizes that fit (validated inputs); None: any world size (train_batch_size is derived)."""
    if tbs is None:
        return None
    per_rank = (mbs or 1) * (gas or 1)  # the part of train_batch_size one rank's given keys fix
    if tbs % per_rank:
        return ()
    if mbs is not None and gas is not None:
        return (tbs // per_rank,)
    return _divisors(tbs // per_rank)  # the one missing key takes up the rest of the quotient


def format_sizes(sizes: tuple[int, ...], shown: int = 6) -> str:
    """``1, 3, 5 or 15``; a long list is cut (``1, 2, 3, 4, 6, 8, ... (13 in all)``)."""
    if len(sizes) > shown:
        return ", ".join(map(str, sizes[:shown])) + f", ... ({len(sizes)} in all)"
    words = [str(s) for s in sizes]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + f" or {words[-1]}"


def _product(mbs: int | None, gas: int | None) -> str:
    parts = [f"train_micro_batch_size_per_gpu ({mbs})" if mbs is not None else "train_micro_batch_size_per_gpu",
             f"gradient_accumulation_steps ({gas})" if gas is not None else "gradient_accumulation_steps"]
    return " * ".join(parts)


def _no_fit(tbs: int, mbs: int | None, gas: int | None) -> str:
    per_rank = (mbs or 1) * (gas or 1)
    return (f"train_batch_size ({tbs}) must equal {_product(mbs, gas)} * data-parallel world size, but "
            f"{tbs} / {per_rank} = {tbs / per_rank:g} is not a whole number, so it fits no world size")


def _nearest(tbs: int, mbs: int | None, gas: int | None) -> str:
    """The nearest train_batch_size values that fit (below and above), and keys to leave out instead."""
    step = (mbs or 1) * (gas or 1)
    below = tbs // step * step
    options = [f"{c} (world size {format_sizes(_fits(c, mbs, gas) or ())})"
               for c in (below, below + step) if c >= step]
    text = "nearest consistent: train_batch_size " + " or ".join(options)
    if mbs is not None and gas is not None:  # keeping train_batch_size: derive one of the other two keys
        for key, kept in ((GAS, (mbs, None)), (MBS, (None, gas))):
            sizes = _fits(tbs, *kept)
            if sizes:
                text += f"; or keep train_batch_size {tbs} and leave out {key} (fits world size {format_sizes(sizes)})"
    return text


def _fit_note(tbs: Any, mbs: Any, gas: Any) -> str:
    """For an error at one world size: the world sizes these keys would fit (or the nearest consistent values)."""
    sizes = _fits(tbs, mbs, gas)
    if sizes is None:
        return ""
    if not sizes:
        return f"; these values fit no world size ({_nearest(tbs, mbs, gas)})"
    return f"; these values fit world size {format_sizes(sizes)}"
