"""Loss scaling for fp16 training: a static scale, or DeepSpeed's dynamic scaler with hysteresis.

The loss is multiplied by ``loss_scale`` before backward so small fp16 gradients do not underflow; the
optimizer wrapper divides the gradients by it again. The dynamic scaler halves the scale after
``hysteresis`` overflowing steps and doubles it after ``loss_scale_window`` clean steps in a row.
"""

from __future__ import annotations

from typing import Any


class StaticLossScaler:
    """A constant loss scale (``fp16.loss_scale > 0``); overflowing steps are still skipped."""

    dynamic = False

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ValueError(f"fp16.loss_scale={scale!r}: a static loss scale must be > 0")
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """A static scale does not move."""

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_scale = float(state["cur_scale"])


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaler (the ``fp16`` section's parameters, under DeepSpeed's names).

    ``delayed_shift`` (``hysteresis``) overflows are tolerated before the scale is divided by
    ``scale_factor``; ``scale_window`` (``loss_scale_window``) clean iterations after the last overflow
    multiply it by ``scale_factor``. ``consecutive_hysteresis`` refills the tolerance on every clean step.
    The scale never goes below ``min_scale``; an overflow at the minimum raises (training cannot recover).
    """

    dynamic = True

    def __init__(self, init_scale: float = 2.0 ** 32, scale_factor: float = 2.0, scale_window: int = 1000,
                 min_scale: float = 1.0, delayed_shift: int = 1, consecutive_hysteresis: bool = False,
                 raise_error_at_min_scale: bool = True) -> None:
        self.cur_scale = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.cur_hysteresis = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """Move the scale after one optimizer step that did (``overflow``) or did not overflow."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale <= self.min_scale and self.raise_error_at_min_scale:
                    raise RuntimeError(f"fp16: gradient overflow with the loss scale already at fp16.min_loss_scale="
                                       f"{self.min_scale:g}; training cannot continue (lower the learning rate or "
                                       "use bf16)")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            # DeepSpeed's count: scale_window clean steps *after* the step that followed the last overflow
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale, "cur_hysteresis": self.cur_hysteresis, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_scale = float(state["cur_scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])


def build_loss_scaler(fp16: Any, dynamic_args: dict[str, Any] | None) -> StaticLossScaler | DynamicLossScaler:
    """The scaler the typed ``fp16`` section asks for (``dynamic_args``: from ``dynamic_loss_scale_args``)."""
    if dynamic_args is None:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(**dynamic_args)
