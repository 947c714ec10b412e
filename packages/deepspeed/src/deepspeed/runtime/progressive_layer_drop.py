"""``deepspeed.runtime.progressive_layer_drop``: the keep-probability schedule of Progressive Layer Dropping.

PLD (https://arxiv.org/abs/2010.13369) skips transformer layers stochastically; the model reads the current keep
probability ``theta(t) = (1 - theta) * exp(-gamma * t) + theta`` from the ``pld_theta`` keyword the engine adds to
its forward call. ``theta(0) = 1`` (keep every layer); it decays towards ``theta`` at rate ``gamma`` per step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deepspeed.utils.logging import log_dist

__all__ = ["ProgressiveLayerDrop"]


class ProgressiveLayerDrop:
    r"""Progressive Layer Dropping (PLD) for model training.

    Args:
        theta (float): the keep probability the schedule decays to; lower trains faster. Default 0.5.
        gamma (float): how fast the drop ratio increases (per global step). Default 0.001.
    """

    def __init__(self, theta: float = 0.5, gamma: float = 0.001) -> None:
        self.theta = theta
        self.gamma = gamma
        self.current_theta = 1.0
        log_dist(f"Enabled progressive layer dropping (theta = {self.theta})", ranks=[0])

    def get_state(self) -> dict[str, Any]:
        """The keyword arguments the engine adds to the model's forward while training."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        """Set the keep probability for ``global_step``."""
        # numpy's exp, as DeepSpeed's: scripts compare the value bit for bit (math.exp may differ in the last ulp)
        self.current_theta = float((1.0 - self.theta) * np.exp(-self.gamma * global_step) + self.theta)
