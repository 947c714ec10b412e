"""``DeepSpeedOptimizer`` and ``ZeROOptimizer``: DeepSpeed's base classes of the optimizer wrappers, for client code
that checks ``isinstance(engine.optimizer, DeepSpeedOptimizer)``.

Here the wrappers share ``ds_zero.loss_scaled.LossScaledWrapper`` instead (ds-zero cannot depend on this package),
so these are abstract base classes with the wrappers registered as virtual subclasses.
"""

from __future__ import annotations

from abc import ABC

from ds_zero.loss_scaled import LossScaledWrapper
from ds_zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from ds_zero.zero3.optimizer import DeepSpeedZeroOptimizer_Stage3


class DeepSpeedOptimizer(ABC):  # noqa: B024 - a marker base, as DeepSpeed's (no abstract methods)
    """Every optimizer wrapper the engine builds (precision, loss scaling, clipping, the update)."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """The ZeRO optimizers (stages 1-3): partitioned optimizer state."""


DeepSpeedOptimizer.register(LossScaledWrapper)
ZeROOptimizer.register(DeepSpeedZeroOptimizer)
ZeROOptimizer.register(DeepSpeedZeroOptimizer_Stage3)
