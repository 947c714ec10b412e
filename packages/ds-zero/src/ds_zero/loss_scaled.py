"""What every optimizer wrapper shows the engine and clients about its torch optimizer and loss scaler.

Shared by the stage-0 precision wrappers (in the ``deepspeed`` package) and ZeRO's; subclasses set
``optimizer`` (the torch optimizer) and ``loss_scaler`` (an object with ``loss_scale``, or None).
"""

from __future__ import annotations

from typing import Any

import torch


class LossScaledWrapper:
    optimizer: torch.optim.Optimizer
    loss_scaler: Any

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0

    @property
    def cur_scale(self) -> float:  # DeepSpeed's FP16_Optimizer attribute name (read by clients)
        return self.loss_scale

    @property
    def scales_loss(self) -> bool:
        """True when gradients must come from a scaled loss (fp16)."""
        return self.loss_scaler is not None

    def needs_scaler(self) -> bool:
        """DeepSpeed's question before a manual backward: must the loss go through ``engine.scale`` (fp16)?"""
        return self.scales_loss

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.loss_scaler is not None else loss

    # ---- the step's shared rules ----------------------------------------------------------------------------
    def _skip_on_overflow(self, overflow: bool) -> bool:
        """Record the verdict; on overflow lower the loss scale and drop the gradients (no update)."""
        self.overflow = overflow
        if overflow:
            self.global_grad_norm = None
            if self.loss_scaler is not None:
                self.loss_scaler.update_scale(True)
            self.zero_grad()
        return overflow

    def _grad_coef(self, norm: float | None, clip: float) -> float:
        """The factor that unscales the gradients and clips their global ``norm`` (unscaled) to ``clip``."""
        coef = 1.0 / self.loss_scale
        if clip > 0 and norm is not None and norm > clip:
            coef *= clip / (norm + 1e-6)
        return coef

    def _stepped(self) -> bool:
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        return True
