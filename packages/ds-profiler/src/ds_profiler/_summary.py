"""The summary block at the top of the printed profile: totals, throughput and, when a DeepSpeed engine is
given, its parallel sizes and wall-clock timers (read duck-typed, so any engine exposing them works)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_profiler._format import duration_to_string, flops_to_string, macs_to_string, number_to_string
from ds_profiler._format import params_to_string as params_str
from ds_profiler._tree import Totals

RULE = "-" * 78
LEGEND = (
    "Notations:\n"
    "data parallel size (dp_size), model parallel size (mp_size),\n"
    "number of parameters (params), number of multiply-accumulate operations (MACs),\n"
    "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
    "fwd latency (forward pass latency), bwd latency (backward pass latency),\n"
    "step (optimizer step latency), iter latency (fwd + bwd + step latency)\n"
)
_FMT = "{:<70}  {:<8}"
# DeepSpeed's global timer names (milliseconds).
_TIMERS = {"fwd": "fwd", "bwd": "bwd", "step": "step"}


@dataclass
class Backward:
    """Measured backward totals (None when no backward pass ran while profiling)."""

    macs: int
    flops: int


def engine_value(engine: Any, name: str) -> Any:
    """``engine.name`` or ``engine.name()``; None when the engine does not expose it."""
    value = getattr(engine, name, None)
    try:
        return value() if callable(value) else value
    except (TypeError, RuntimeError):
        return None


def engine_timer_s(engine: Any, name: str) -> float | None:
    """Elapsed seconds of an engine wall-clock timer when ``wall_clock_breakdown`` is on, else None."""
    if engine is None or not engine_value(engine, "wall_clock_breakdown"):
        return None
    try:
        return float(engine.timers(_TIMERS[name]).elapsed(False)) / 1000.0
    except (AttributeError, KeyError, TypeError):
        return None


def _engine_lines(engine: Any) -> list[str]:
    rows = (("world size: ", "world_size"), ("data parallel size: ", "dp_world_size"),
            ("model parallel size: ", "mp_world_size"), ("batch size per GPU: ", "train_micro_batch_size_per_gpu"))
    lines = []
    for label, attr in rows:
        value = engine_value(engine, attr)
        if value is not None:
            lines.append(_FMT.format(label, value))
    return lines


def _rate(flops: float, seconds: float | None) -> str:
    return flops_to_string(flops / seconds) if seconds else flops_to_string(0)


def _training_lines(engine: Any, fwd_flops: float, fwd_s: float, bwd_flops: float, bwd_label: str) -> list[str]:
    bwd_s, step_s = engine_timer_s(engine, "bwd"), engine_timer_s(engine, "step")
    if bwd_s is None:
        return []
    step_flops = fwd_flops + bwd_flops
    lines = [
        _FMT.format("bwd latency: ", duration_to_string(bwd_s)),
        _FMT.format(f"bwd FLOPS per GPU = {bwd_label} / bwd latency: ", _rate(bwd_flops, bwd_s)),
        _FMT.format("fwd+bwd FLOPS per GPU = fwd+bwd flops per GPU / (fwd+bwd latency): ",
                    _rate(step_flops, fwd_s + bwd_s)),
    ]
    if step_s is not None:
        iter_s = fwd_s + bwd_s + step_s
        lines += [_FMT.format("step latency: ", duration_to_string(step_s)),
                  _FMT.format("iter latency: ", duration_to_string(iter_s)),
                  _FMT.format("FLOPS per GPU = fwd+bwd flops per GPU / iter latency: ", _rate(step_flops, iter_s))]
        batch, world = engine_value(engine, "train_micro_batch_size_per_gpu"), engine_value(engine, "world_size")
        if batch and world:
            lines.append(_FMT.format("samples/second: ", f"{batch * world / iter_s:.2f}"))
    return lines


def summary_lines(
    profile_step: int, totals: Totals, engine: Any, backward: Backward | None, recompute_fwd_factor: float
) -> list[str]:
    """The header block: engine sizes, params, forward MACs/flops/latency/FLOPS, backward when known."""
    mp = engine_value(engine, "mp_world_size") if engine is not None else None
    mp = int(mp) if mp else 1
    fwd_s = engine_timer_s(engine, "fwd") or totals.duration
    lines = ["", "-------------------------- DeepSpeed Flops Profiler --------------------------",
             f"Profile Summary at step {profile_step}:", LEGEND]
    lines += _engine_lines(engine) if engine is not None else []
    lines += [
        _FMT.format("params per GPU: ", params_str(totals.params)),
        _FMT.format("params of model = params per GPU * mp_size: ", params_str(totals.params * mp)),
        _FMT.format("fwd MACs per GPU: ", macs_to_string(totals.macs)),
        _FMT.format("fwd flops per GPU: ", number_to_string(totals.flops)),
        _FMT.format("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(totals.flops * mp)),
        _FMT.format("fwd latency: ", duration_to_string(fwd_s)),
        _FMT.format("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", _rate(totals.flops, fwd_s)),
    ]
    if backward is not None:
        bwd_flops, bwd_label = backward.flops, "measured bwd flops per GPU"
        lines += [
            _FMT.format("bwd MACs per GPU (measured): ", macs_to_string(backward.macs)),
            _FMT.format("bwd flops per GPU (measured): ", number_to_string(backward.flops)),
        ]
    else:
        factor = 2 + recompute_fwd_factor
        bwd_flops, bwd_label = factor * totals.flops, f"{factor:g} * fwd flops per GPU"
        lines.append(_FMT.format(f"bwd flops per GPU (estimate, {bwd_label}): ", number_to_string(bwd_flops)))
    lines.append(_FMT.format("fwd+bwd flops per GPU (one training step): ", number_to_string(totals.flops + bwd_flops)))
    lines += _training_lines(engine, totals.flops, fwd_s, bwd_flops, bwd_label)
    return lines
