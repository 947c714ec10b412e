"""Mixed-precision sections: ``fp16``, ``bf16``, ``amp``, ``torch_autocast`` and ``data_types``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ds_config._base import DSConfigModel
from ds_config._types import Bool, DType, Float, Int, LowDType, NonNeg, PosInt

DEFAULT_AUTOCAST_LOWER_PRECISION_MODULES = ["torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d", "torch.nn.Conv3d"]
"""Modules whose gradients/parameters ``torch_autocast`` downcasts for communication when none are listed."""


class FP16Config(DSConfigModel):
    """``fp16``: DeepSpeed's native fp16 mixed precision with (dynamic) loss scaling."""

    enabled: Bool = False
    """Enable fp16 mixed-precision training."""
    auto_cast: Bool = False
    """Cast the module's floating-point inputs to fp16 in ``engine.forward``."""
    loss_scale: Float = Field(0.0, ge=0)
    """Static loss scale; ``0.0`` selects dynamic loss scaling."""
    initial_scale_power: NonNeg = 32
    """Dynamic loss scaling starts at ``2**initial_scale_power`` (the documented default is 32)."""
    loss_scale_window: Int = 1000
    """Steps without overflow before the dynamic loss scale is raised (> 0 when the scale is dynamic)."""
    hysteresis: PosInt = 2
    """Overflows tolerated before the dynamic loss scale is lowered (delay shift)."""
    consecutive_hysteresis: Bool = False
    """Refill the hysteresis counter on every step that does not overflow."""
    min_loss_scale: Float = 1000
    """Floor of the dynamic loss scale (the documented default is 1000; > 0 when the scale is dynamic)."""
    fp16_master_weights_and_grads: Bool = False
    """Keep master weights and gradients in fp16 (ZeRO-Offload with CPU Adam only)."""

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _loss_scale_is_a_number(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"fp16.loss_scale must be a number (0 for dynamic loss scaling), got "
                             f"{type(value).__name__} {value!r}")
        return value

    @model_validator(mode="after")
    def _dynamic_scaling_bounds(self) -> FP16Config:
        # as DeepSpeed: the window and the floor only matter while the scale is dynamic (fp16 on, loss_scale 0),
        # so other configs may carry any value for them
        if self.enabled and self.loss_scale == 0:
            for key in ("loss_scale_window", "min_loss_scale"):
                if getattr(self, key) <= 0:
                    raise ValueError(f"fp16.{key} must be > 0 when dynamic loss scaling is on (loss_scale 0), "
                                     f"got {getattr(self, key)}")
        return self

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0

    def initial_dynamic_scale(self) -> int:
        """Starting dynamic loss scale, ``2 ** initial_scale_power`` (a method, as on DeepSpeed's
        ``DeepSpeedFP16Config``)."""
        return 2**self.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """Keyword arguments of DeepSpeed's ``DynamicLossScaler`` (``init_scale``, ``scale_window``,
        ``delayed_shift``, ``consecutive_hysteresis``, ``min_scale``) from this section."""
        return {"init_scale": self.initial_dynamic_scale(), "scale_window": self.loss_scale_window,
                "delayed_shift": self.hysteresis, "consecutive_hysteresis": self.consecutive_hysteresis,
                "min_scale": self.min_loss_scale}


class BF16Config(DSConfigModel):
    """``bf16`` (older name ``bfloat16``): bfloat16 mixed precision; needs no loss scaling."""

    enabled: Bool = False
    """Enable bfloat16 mixed-precision training."""
    immediate_grad_update: Bool = False
    """Apply gradients to the fp32 master copy as soon as they are reduced (saves a gradient buffer). False as in
    DeepSpeed 0.19.6's schema (its ``constants.BFLOAT16_IMMEDIATE_GRAD_UPDATE_DEFAULT`` still says True, unused)."""
    check_grad_overflow: Bool = True
    """Check bf16 gradients for inf/nan and skip the step when found (DeepSpeed 0.19's default: without it one
    NaN gradient silently turns every weight into NaN)."""
    bf16_master_weights_and_grads: Bool = False
    """Keep master weights and gradients in bf16 instead of fp32."""
    bf16_optimizer_states: Bool = False
    """Keep optimizer states in bf16 (with ``bf16_master_weights_and_grads``)."""


class AMPConfig(DSConfigModel):
    """``amp``: NVIDIA Apex AMP. Keys other than ``enabled`` go to ``apex.amp.initialize`` unchanged."""

    enabled: Bool = False
    """Enable Apex AMP."""
    opt_level: Literal["O0", "O1", "O2", "O3"] | None = None
    """Apex optimisation level (``"O1"`` is Apex's recommendation)."""
    cast_model_type: str | None = None
    patch_torch_functions: Bool | None = None
    keep_batchnorm_fp32: Bool | str | None = None
    master_weights: Bool | None = None
    loss_scale: Float | Literal["dynamic"] | None = None
    cast_model_outputs: str | None = None
    num_losses: PosInt | None = None
    verbosity: NonNeg | None = None
    min_loss_scale: Float | None = None
    max_loss_scale: Float | None = None

    def apex_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``apex.amp.initialize``: every key the user set except ``enabled``."""
        return {k: getattr(self, k) for k in self.model_fields_set if k != "enabled"}


class TorchAutocastConfig(DSConfigModel):
    """``torch_autocast``: run ``engine.forward`` under ``torch.autocast`` with a gradient scaler."""

    enabled: Bool = False
    """Enable ``torch.autocast`` inside the engine."""
    dtype: LowDType = "bf16"
    """Lower-precision dtype passed to ``torch.autocast`` (``bfloat16`` or ``float16``)."""
    lower_precision_safe_modules: list[str] | None = None
    """Module classes whose communication is downcast; ``None`` means the documented default list."""

    @property
    def safe_modules(self) -> list[str]:
        if self.lower_precision_safe_modules is None:
            return list(DEFAULT_AUTOCAST_LOWER_PRECISION_MODULES)
        return list(self.lower_precision_safe_modules)


class DataTypesConfig(DSConfigModel):
    """``data_types``: dtypes of internal buffers."""

    grad_accum_dtype: DType | None = None
    """dtype of gradient accumulation; ``None`` matches the model's dtype."""
    param_dtype: DType | None = None
    """Must match the training precision (fp16 / bf16 / fp32) when given; the weights follow the precision."""
    buffer_dtype: DType | None = None
    """Cast the model's floating-point buffers to this dtype; ``None`` leaves them to the precision cast."""
    keep_in_fp32_modules: list[str] | None = None
    """DeepSpeed 0.19.8: name patterns of modules whose buffers stay fp32 (``"auto"``: the Hugging Face model's
    own list); validated, no effect here."""
