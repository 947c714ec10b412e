"""``deepspeed.runtime.fp16.loss_scaler``: DeepSpeed's loss scalers under their documented names.

``LossScaler`` (static) and ``DynamicLossScaler`` extend the engine's scalers (``runtime.precision.loss_scalers``:
same state, ``state_dict``) with DeepSpeed 0.19's constructor signatures, attributes and methods (``scale_loss``,
``backward``, ``scale_gradient``, ``has_overflow_serial``); an instance unpickled from a DeepSpeed checkpoint works as
one built here. ``DynamicLossScaler.update_scale`` is DeepSpeed 0.19's: the scale grows after ``scale_window`` clean
steps *following* the last overflow (the step after a stable window). ``CreateLossScaler`` builds one from the ``fp16``
section's values; ``LossScaleConfig`` resolves them per precision (no scaling unless fp16).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from deepspeed.runtime.precision.loss_scalers import DynamicLossScaler as _DynamicScaler
from deepspeed.runtime.precision.loss_scalers import StaticLossScaler as _StaticScaler
from deepspeed.runtime.utils import has_inf_or_nan
from deepspeed.utils.logging import log_dist

__all__ = ["CONSECUTIVE_HYSTERESIS", "DELAYED_SHIFT", "INITIAL_LOSS_SCALE", "MIN_LOSS_SCALE", "SCALE_WINDOW",
           "CreateLossScaler", "DynamicLossScaler", "LossScaleConfig", "LossScaleProfile", "LossScaler",
           "LossScalerBase", "to_python_float"]

# keys of ``dynamic_loss_args`` (the engine's ``dynamic_loss_scale_args()``)
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


class LossScaleProfile(str, Enum):
    """Which optimizer family's defaults apply when no dynamic arguments are given."""

    FUSED = "fused"
    UNFUSED = "unfused"


@dataclass(frozen=True)
class LossScaleProfileDefaults:
    initial_dynamic_scale: float
    default_scale_window: int
    default_min_loss_scale: float
    scale_factor: float


LOSS_SCALE_PROFILE_DEFAULTS = {
    LossScaleProfile.FUSED: LossScaleProfileDefaults(2.0**32, 1000, 1, 2.0),
    LossScaleProfile.UNFUSED: LossScaleProfileDefaults(2.0**16, 1000, 0.25, 2.0),
}


def _positive_finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


_CHECKS = {INITIAL_LOSS_SCALE: _positive_finite, SCALE_WINDOW: _positive_int, DELAYED_SHIFT: _positive_int,
           MIN_LOSS_SCALE: _positive_finite}


def _validated_dynamic_args(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with its scale/window/shift values checked (positive, finite) and normalised."""
    return {key: _CHECKS[key](value, f"dynamic_loss_args['{key}']") if key in _CHECKS else value
            for key, value in args.items()}


class LossScaleConfig:
    """The loss-scaling state an optimizer starts from: none unless ``low_precision_dtype`` is fp16; then the
    static ``static_loss_scale``, or (``dynamic_loss_scale``) ``dynamic_loss_args`` / the profile's defaults."""

    def __init__(self, low_precision_dtype: torch.dtype, dynamic_loss_scale: bool, static_loss_scale: float,
                 dynamic_loss_args: dict[str, Any] | None, *, profile: LossScaleProfile = LossScaleProfile.FUSED,
                 initial_dynamic_scale: float | None = None) -> None:
        defaults = LOSS_SCALE_PROFILE_DEFAULTS[profile]
        self.use_grad_scaling = low_precision_dtype == torch.float16
        self.dynamic_loss_scale = False
        self.cur_iter = 0
        self.cur_scale = 1.0
        self.last_overflow_iter: int | None = None
        self.scale_factor: float | None = None
        self.scale_window: int | None = None
        self.min_loss_scale: float | None = None
        if not self.use_grad_scaling:
            return
        if not dynamic_loss_scale:
            self.cur_scale = _positive_finite(static_loss_scale, "fp16.loss_scale")
            return
        self.dynamic_loss_scale = True
        self.last_overflow_iter = -1
        self.scale_factor = defaults.scale_factor
        if dynamic_loss_args is None:
            init = defaults.initial_dynamic_scale if initial_dynamic_scale is None else initial_dynamic_scale
            self.cur_scale = _positive_finite(init, "dynamic_loss_args['init_scale']")
            self.scale_window = defaults.default_scale_window
            self.min_loss_scale = defaults.default_min_loss_scale
            return
        args = _validated_dynamic_args(dynamic_loss_args)
        self.cur_scale = args[INITIAL_LOSS_SCALE]
        self.scale_window = args[SCALE_WINDOW]
        self.min_loss_scale = args[MIN_LOSS_SCALE]

    def __repr__(self) -> str:
        return f"LossScaleConfig({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def to_python_float(t: Any) -> float:
    """A one-element tensor (or a sequence) as a Python number."""
    return t.item() if hasattr(t, "item") else t[0]


class LossScalerBase:
    """What every DeepSpeed loss scaler offers: ``loss_scale`` and scaling a loss or gradients by it."""

    dynamic = False

    def __init__(self, cur_scale: float) -> None:
        self.cur_scale = cur_scale

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: Iterable[torch.Tensor], grad_out: Any) -> tuple[torch.Tensor, ...]:
        return tuple(self.loss_scale * g for g in grad_in)

    def update_scale(self, overflow: bool) -> None:
        """A static scale does not move."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (scaling without running backward)."""
        return loss * self.loss_scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.scale_loss(loss).backward(retain_graph=retain_graph)


class LossScaler(_StaticScaler, LossScalerBase):
    """A static loss scale (``fp16.loss_scale > 0``)."""

    def __init__(self, scale: float = 1) -> None:
        _StaticScaler.__init__(self, scale)
        self.dynamic = False

    def has_overflow(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return False


class DynamicLossScaler(_DynamicScaler, LossScalerBase):
    """DeepSpeed's dynamic loss scaler: divide the scale by 2 (``scale_factor``) once ``delayed_shift`` overflowing
    steps have been tolerated, never below ``min_scale``; multiply it by 2 after each ``scale_window`` clean steps
    since the last overflow. ``dtype`` is the training dtype (log messages only)."""

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, delayed_shift: int,
                 consecutive_hysteresis: bool, raise_error_at_min_scale: bool = True,
                 dtype: torch.dtype = torch.half) -> None:
        _DynamicScaler.__init__(self, init_scale=init_scale, scale_factor=2.0, scale_window=scale_window,
                                min_scale=min_scale, delayed_shift=delayed_shift,
                                consecutive_hysteresis=consecutive_hysteresis,
                                raise_error_at_min_scale=raise_error_at_min_scale)
        self.dynamic = True
        self.dtype = dtype

    def has_overflow_serial(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Whether any parameter's gradient holds inf or nan."""
        return any(p.grad is not None and bool(has_inf_or_nan(p.grad.data)) for p in params)

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> torch.Tensor:
        return has_inf_or_nan(x)

    def update_scale(self, overflow: bool) -> None:
        """Move the scale after one step that did (``overflow``) or did not overflow."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise Exception("Current loss scale already at minimum - cannot decrease scale anymore. "
                                    "Exiting run.")
                next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                log_dist(f"[deepspeed] OVERFLOW! Skipping step. Attempted loss scale: {self.cur_scale:g}, reducing "
                         f"to {next_scale:g}", ranks=[0])
                self.cur_scale = next_scale
            else:
                log_dist(f"[deepspeed] OVERFLOW! Skipping step. Attempted loss scale: {self.cur_scale:g}, but "
                         f"hysteresis is {self.cur_hysteresis}. Reducing hysteresis to {self.cur_hysteresis - 1}",
                         ranks=[0])
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = self.cur_iter - self.last_overflow_iter - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def CreateLossScaler(dtype: torch.dtype, static_loss_scale: float, dynamic_scaling: bool,  # noqa: N802 - DeepSpeed's
                     dynamic_loss_args: dict[str, Any] | None) -> LossScaler | DynamicLossScaler:
    """The scaler for training in ``dtype``: dynamic (``dynamic_loss_args``: the engine's
    ``dynamic_loss_scale_args()``) for fp16 with ``dynamic_scaling``, otherwise static (``static_loss_scale`` for
    fp16, 1.0 for other dtypes)."""
    if dtype == torch.half and dynamic_scaling:
        if dynamic_loss_args is None:
            raise ValueError("CreateLossScaler: dynamic loss scaling needs dynamic_loss_args (init_scale, "
                             "scale_window, min_scale, delayed_shift, consecutive_hysteresis)")
        return DynamicLossScaler(dtype=dtype, **_validated_dynamic_args(dynamic_loss_args))
    scale = static_loss_scale if dtype == torch.half else 1.0
    return LossScaler(scale=_positive_finite(scale, "fp16.loss_scale"))
