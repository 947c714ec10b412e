"""``FlopsProfiler``: DeepSpeed's flops-profiler API over the dispatch-mode counter."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ds_profiler._counter import ModuleStats, Recorder, Session
from ds_profiler._format import duration_to_string, macs_to_string, number_to_string, params_to_string
from ds_profiler._summary import RULE, Backward, summary_lines
from ds_profiler._tree import aggregated_lines, param_count, render, to_dict, totals_of

DETAILED_HEADER = (
    "Each module profile is listed after its name in the following order:\n"
    "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
    "percentage of total fwd latency, fwd FLOPS\n\n"
    "Note: 1. A module's figures include its submodules and any torch function it calls itself, so a parent "
    "can exceed the sum of its children.\n"
    "2. FLOPs are an analytic estimate, so the FLOPS derived from them can exceed what the hardware delivers.\n"
    "3. The latency is taken at the module's forward call, without the runtime's own overhead.\n"
)


def synchronizer(model: nn.Module) -> Callable[[], None] | None:
    """A barrier for accelerator timing (None on CPU): latency must include the queued kernels."""
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    if tensor is None or tensor.device.type in ("cpu", "meta"):
        return None
    device = tensor.device
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        return lambda: accelerator.synchronize(device)
    backend = getattr(torch, device.type, None)
    return getattr(backend, "synchronize", None)


def ignore_types(ignore_list: Iterable[Any] | None, name: str = "ignore_list") -> tuple[type, ...]:
    """Validate a list of module classes to exclude."""
    if ignore_list is None:
        return ()
    if isinstance(ignore_list, type) or not isinstance(ignore_list, (list, tuple, set, frozenset)):
        raise TypeError(f"{name} must be a list of nn.Module subclasses, got {ignore_list!r}")
    for item in ignore_list:
        if not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise TypeError(f"{name} entries must be nn.Module subclasses (e.g. torch.nn.Dropout), got {item!r}")
    return tuple(ignore_list)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class FlopsProfiler:
    """Measures parameters, MACs, FLOPs and latency of every module of ``model`` while profiling is on.

    ``recompute_fwd_factor`` is the fraction of the forward pass recomputed in backward by activation
    checkpointing (0.0 none, 1.0 all); it enters the backward estimate ``(2 + factor) x fwd flops`` used when
    no backward pass was observed.
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        is_number = isinstance(recompute_fwd_factor, (int, float)) and not isinstance(recompute_fwd_factor, bool)
        if not is_number or not recompute_fwd_factor >= 0.0:
            raise ValueError(f"recompute_fwd_factor must be a number >= 0.0, got {recompute_fwd_factor!r}")
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.started = False
        # Totals of the last printed profile (DeepSpeed exposes these for its autotuner).
        self.flops, self.macs, self.params = 0, 0, 0
        self._recorder: Recorder | None = None
        self._session: Session | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start_profile(self, ignore_list: list[type] | None = None) -> None:
        """Start counting: hooks on every module and a dispatch mode on this thread. Modules whose type is
        in ``ignore_list`` (and their submodules) contribute no MACs/FLOPs. Restarts if already running."""
        ignore = ignore_types(ignore_list)
        self.stop_profile()
        self._recorder = Recorder(sync=synchronizer(self.model))
        self._session = Session(self.model, self._recorder, ignore)
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting: hooks removed, dispatch mode left. The figures stay readable."""
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def reset_profile(self) -> None:
        """Zero the figures (profiling continues if it is on)."""
        if self._recorder is not None:
            self._recorder.reset()

    def end_profile(self) -> None:
        """Stop and discard the profile; the model is left exactly as before ``start_profile``."""
        try:
            self.stop_profile()
        finally:
            self._recorder = None
            self.started = False

    # ---- totals ----------------------------------------------------------------------------------------
    def _require(self) -> Recorder:
        if self._recorder is None:
            raise RuntimeError("no profile: call start_profile() and run the model first "
                               "(end_profile() discards the profile)")
        return self._recorder

    def _root(self) -> ModuleStats:
        return self._require().modules[self.model]

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Floating-point operations of the profiled forward pass(es)."""
        flops = self._root().flops
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Multiply-accumulate operations of the profiled forward pass(es)."""
        macs = self._root().macs
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Forward latency of the model in seconds (summed over the profiled calls)."""
        duration = self._root().duration
        return duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters stored per rank (every parameter, trainable or frozen, shared ones once)."""
        params = param_count(self.model)
        return params_to_string(params) if as_string else params

    def backward_observed(self) -> bool:
        """Whether any backward op ran while profiling."""
        return self._require().backward.calls > 0

    def get_total_backward_flops(self, as_string: bool = False) -> int | str:
        """FLOPs of the backward pass(es) that ran while profiling (0 if none)."""
        flops = self._require().backward.flops
        return number_to_string(flops) if as_string else flops

    def get_total_backward_macs(self, as_string: bool = False) -> int | str:
        """MACs of the backward pass(es) that ran while profiling (0 if none)."""
        macs = self._require().backward.macs
        return macs_to_string(macs) if as_string else macs

    def get_total_step_flops(self, as_string: bool = False) -> int | float | str:
        """FLOPs of one training step: forward + measured backward, or, when no backward was observed,
        forward x (3 + recompute_fwd_factor)."""
        fwd = self.get_total_flops()
        if self.backward_observed():
            step = fwd + self.get_total_backward_flops()
        else:
            step = fwd * (3 + self.recompute_fwd_factor)
        return number_to_string(step) if as_string else step

    def get_op_breakdown(self, backward: bool = False) -> dict[str, dict[str, int]]:
        """Per aten op: calls, MACs and FLOPs (forward ops inside the model, or backward ops)."""
        recorder = self._require()
        table = recorder.backward_ops if backward else recorder.forward_ops
        return {name: {"calls": s.calls, "macs": s.macs, "flops": s.flops} for name, s in sorted(table.items())}

    # ---- reports ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The whole profile as JSON-ready data: totals, the module tree, per-op breakdowns."""
        recorder = self._require()
        backward = recorder.backward
        return {
            "format": "ds_profiler.profile/1",
            "totals": {"params": self.get_total_params(), "macs": self.get_total_macs(),
                       "flops": self.get_total_flops(), "duration_s": self.get_total_duration(),
                       "backward_macs": backward.macs, "backward_flops": backward.flops,
                       "step_flops": self.get_total_step_flops(),
                       "recompute_fwd_factor": self.recompute_fwd_factor},
            "modules": to_dict(self.model, recorder),
            "forward_ops": self.get_op_breakdown(),
            "backward_ops": self.get_op_breakdown(backward=True),
        }

    def to_json(self, path: str | None = None, indent: int = 2) -> str:
        """``to_dict()`` as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")
        return text

    def model_profile_text(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                           detailed: bool = True) -> str:
        """The text ``print_model_profile`` prints."""
        _check_int("module_depth", module_depth, -1)
        _check_int("top_modules", top_modules, 1)
        recorder = self._require()
        totals = totals_of(self.model, recorder)
        backward = Backward(recorder.backward.macs, recorder.backward.flops) if recorder.backward.calls else None
        lines = summary_lines(profile_step, totals, self.ds_engine, backward, self.recompute_fwd_factor)
        lines += ["", "----------------------------- Aggregated Profile per GPU -----------------------------"]
        lines += aggregated_lines(self.model, recorder, module_depth, top_modules)
        if detailed:
            lines += ["", "------------------------------ Detailed Profile per GPU ------------------------------",
                      DETAILED_HEADER]
            if backward is not None:
                lines.append("bwd: MACs of the backward of the autograd nodes each module's forward created.\n")
            lines.append(render(self.model, recorder, totals, module_depth))
        lines.append(RULE)
        return "\n".join(lines) + "\n"

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> None:
        """Print the summary, the aggregated top modules and (``detailed``) the module tree down to
        ``module_depth`` (-1: all); to ``output_file`` instead of stdout when given."""
        text = self.model_profile_text(profile_step, module_depth, top_modules, detailed)
        self.flops, self.macs, self.params = self.get_total_flops(), self.get_total_macs(), self.get_total_params()
        if output_file is None:
            sys.stdout.write(text)
            return
        with open(output_file, "w", encoding="utf-8") as handle:
            handle.write(text)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print the top ``top_modules`` module classes by params, MACs and latency at each depth."""
        _check_int("module_depth", module_depth, -1)
        _check_int("top_modules", top_modules, 1)
        print("\n".join(aggregated_lines(self.model, self._require(), module_depth, top_modules)))
