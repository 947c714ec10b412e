"""``zero_optimization.zenflow``: ZenFlow, stall-free CPU-offloaded training.

ZenFlow updates the most important gradient columns (the top ``topk_ratio``) on the accelerator every step
and folds the rest into an asynchronous CPU optimizer step every ``update_interval`` steps. The API
reference lists only the section itself (``zenflow: Optional[ZenFlowConfig] = None``); the keys below are
those DeepSpeed's ZenFlow reads, with its defaults.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

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

    steps_per_epoch: PosInt | None = Field(None, validate_default=True)
    """Optimizer steps per epoch; required with ``select_strategy='epoch'``."""

    pt_reserved_cores_perc: Fraction = 0.5
    """Fraction of CPU cores left to PyTorch; the rest run the CPU optimizer."""

    @field_validator("steps_per_epoch")
    @classmethod
    def _epoch_needs_length(cls, value: int | None, info: ValidationInfo) -> int | None:
        if info.data.get("select_strategy") == "epoch" and value is None:
            raise ValueError("required when select_strategy is 'epoch' (ZenFlow counts epochs in steps)")
        return value
