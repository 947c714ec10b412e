"""Caller-owned gradient accumulation (``"managed_gradient_accumulation": false``).

The engine counts no accumulation window: ``backward()`` only accumulates, and every ``step()`` is the boundary
(``is_gradient_accumulation_boundary()`` is true only while it runs), so the caller may run any number of
backward calls per optimizer step, a different number each time. ZeRO stages 2 and 3 reduce into their
gradient partitions on every backward either way; stages 0 and 1 reduce at the boundary, so here ``step()``
runs the reduction of the gradients accumulated since the last step before the update. ``global_samples``
grows by the micro-batches actually run (backward calls), not by ``train_batch_size``.
"""

from __future__ import annotations

from typing import Any

from ds_config import ConfigError, ConfigProblem

KEY = "managed_gradient_accumulation"


class UnmanagedAccumulationConfigError(ConfigError, AssertionError):
    """A config combining unmanaged accumulation with what cannot honour it: a ``ConfigError`` naming the key,
    and the ``AssertionError`` DeepSpeed's engine raises there."""


class UnmanagedAccumulationError(RuntimeError, AssertionError):
    """A call that moves the accumulation boundary itself, made while the caller owns it (DeepSpeed asserts)."""


def check(engine: Any) -> None:
    """Refuse, at ``initialize``, what cannot run with ``step()`` as the only boundary."""
    config = engine._config
    if config.managed_gradient_accumulation:
        return
    problems = []
    if config.zero_stage < 2 and config.zero_optimization.overlap_comm:
        problems.append(ConfigProblem("zero_optimization.overlap_comm", f"{KEY}=False supports ZeRO overlap_comm "
                                      "only with ZeRO stage 2 or 3 (stages 0/1 reduce in step(), after backward); "
                                      "accepted: false", True))
    if engine.pipeline_parallelism:
        problems.append(ConfigProblem(KEY, f"{KEY}=False is not supported with pipeline parallelism (the pipeline "
                                      "schedule owns the accumulation boundary); accepted: true", False))
    if config.compile.deepcompile:
        problems.append(ConfigProblem(KEY, f"{KEY}=False is not supported with DeepCompile; accepted: true", False))
    if problems:
        raise UnmanagedAccumulationConfigError(problems)


def refuse(engine: Any, call: str) -> None:
    """``call`` would set the boundary, which the caller's ``step()`` owns."""
    if not engine._config.managed_gradient_accumulation:
        raise UnmanagedAccumulationError(f"{call} is not supported with {KEY}=False: the caller owns the "
                                         "accumulation boundary by calling step() (run the backward calls, then "
                                         "one step())")


def reduce_accumulated(engine: Any) -> None:
    """Stages 0/1 at ``step()``: average what the backward calls since the last step accumulated locally, as the
    boundary backward does in managed mode (stages 2/3 reduced each backward already)."""
    reducer = engine.reducer
    if reducer.every_micro_step or engine.seq_dp_world_size <= 1:
        return
    for p in reversed(engine._grad_params):  # the order backward hands gradients over: buckets go out in order
        reducer.grad_ready(p)
    reducer.finish()


def samples_since_step(engine: Any) -> int:
    """Samples of the micro-batches run since the last step (a micro-batch on every data-parallel rank each)."""
    per_micro_batch = engine.train_batch_size() // engine.gradient_accumulation_steps()
    count, engine._backwards_since_step = engine._backwards_since_step, 0
    return per_micro_batch * count
