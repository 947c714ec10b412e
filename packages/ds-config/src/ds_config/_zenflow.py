"""``zero_optimization.zenflow``: ZenFlow, stall-free CPU-offloaded training.

ZenFlow updates the most important gradient columns (the top ``topk_ratio``) on the accelerator every step
and folds the rest into an asynchronous CPU optimizer step every ``update_interval`` steps. The API
reference lists only the section itself (``zenflow: Optional[ZenFlowConfig] = None``); the keys below are
those DeepSpeed's ZenFlow reads, with its defaults.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ds_config._errors import ConfigError, ConfigProblem
from ds_config._typed_section import Bool, Fraction, NonNegInt, PosInt, SectionModel


class ZenFlowConfig(SectionModel):
    """Settings of ZenFlow (importance-aware offloaded optimizer updates)."""

    topk_ratio: Fraction = 0.1
    """Fraction of gradient columns treated as important and updated on the accelerator each step."""

    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    """When the important columns are re-selected: every ``select_interval`` steps, every epoch, or auto."""

    select_interval: PosInt | Literal["auto"] = "auto"
    """Steps (or epochs with ``select_strategy='epoch'``) between re-selections; 'auto' lets ZenFlow pick."""

    update_interval: PosInt | Literal["auto"] = "auto"
    """Steps between CPU updates of the unimportant columns; 'auto' adapts it using ``auto_ratio``."""

    overlap_step: Bool = False
    """Overlap the CPU optimizer step with the next forward/backward pass."""

    offload: Bool = False
    """Keep the unimportant gradients and optimizer states on CPU."""

    auto_ratio: Fraction = 0.99
    """Threshold on accumulated gradient importance that triggers an update when ``update_interval='auto'``."""

    full_warm_up_rounds: NonNegInt = 0
    """Initial steps that update every column on the accelerator before selective updates start."""

    pt_reserved_cores_perc: Fraction = 0.5
    """Fraction of CPU cores left to PyTorch; the rest run the CPU optimizer."""

    steps_per_epoch: PosInt | None = Field(None, exclude=True)
    """Optimizer steps per epoch, filled in by the engine from the training dataloader for
    ``select_strategy='epoch'``; not a user setting, so it is left out of dumps."""

    @model_validator(mode="after")
    def _step_strategy_needs_interval(self) -> ZenFlowConfig:
        # 'step' and 'epoch' count select_interval in their own unit; only 'auto' picks it. With steps the
        # two intervals are comparable here: re-selecting more often than updating would discard selections.
        if self.select_strategy != "auto" and self.select_interval == "auto":
            raise ConfigError(ConfigProblem(
                "select_interval", f"must be an integer >= 1 with select_strategy '{self.select_strategy}' ('auto' "
                "goes with select_strategy 'auto')", self.select_interval))
        if (self.select_strategy == "step" and isinstance(self.update_interval, int)
                and self.select_interval < self.update_interval):
            raise ConfigError(ConfigProblem(
                "select_interval", f"must be >= update_interval ({self.update_interval}) with select_strategy "
                "'step'", self.select_interval))
        return self
