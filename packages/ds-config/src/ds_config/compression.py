"""``compression_training``: layer reduction, weight/activation quantization and four kinds of pruning.

Each technique has ``shared_parameters`` (one set for all its groups) and ``different_groups`` (group name ->
``params`` + ``modules`` [+ ``related_modules`` for row/head/channel pruning]). Defaults are the ones in the
Compression chapter of the config reference; where the library's code uses another value (schedule offsets
of 1000, activation ``range_calibration`` "dynamic") the documented value wins.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ds_config._base import DSConfigModel
from ds_config._errors import _MISSING, ConfigError, ConfigProblem, join_path

ALL_MODULES = "*"
_BLOCK_PATTERN = re.compile(r"^\d+(x|:)\d+$")


def _error_at(where: str | tuple, message: str, value: Any = _MISSING, **ctx: Any) -> ConfigError:
    """A ``ConfigError`` at ``where`` (a key path relative to the model being validated; the base class
    prefixes the section's path). ``message`` is formatted with ``ctx``."""
    path = join_path(*where) if isinstance(where, tuple) else where
    return ConfigError(ConfigProblem(path, message.format(**ctx), value))


# ---------------------------------------------------------------- groups


class CompressionGroup(DSConfigModel):
    """One entry of ``different_groups``: the modules (name regexes) a parameter set applies to."""

    modules: list[str] = Field(default_factory=lambda: [ALL_MODULES], min_length=1)
    """Module-name patterns in scope; the default ``"*"`` means all Linear and Conv2d layers."""

    @field_validator("modules", mode="before")
    @classmethod
    def _one_pattern(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # the library also accepts a bare string


class RelatedModulesGroup(CompressionGroup):
    """A pruning group whose pruned dimension propagates to other modules."""

    related_modules: list[list[str]] | None = None
    """Per entry of ``modules``, the modules whose matching dimension is pruned along with it."""

    @model_validator(mode="after")
    def _one_list_per_module(self) -> RelatedModulesGroup:
        related = self.related_modules
        if related is not None and len(related) != len(self.modules):
            raise _error_at(("related_modules",), "needs one list per entry of modules ({n}), got {m}",
                            related, n=len(self.modules), m=len(related))
        return self


class WeightQuantizationParams(DSConfigModel):
    """``params`` of a weight-quantization group."""

    start_bits: int = Field(8, ge=1, le=32)
    """Bits at the start; reduced step by step to ``target_bits``."""
    target_bits: int = Field(8, ge=1, le=32)
    """Final bits; at most ``start_bits``."""
    quantization_period: int = Field(1, ge=1)
    """Steps between two one-bit reductions."""

    @model_validator(mode="after")
    def _bits_decrease(self) -> WeightQuantizationParams:
        if self.target_bits > self.start_bits:
            raise _error_at(("target_bits",), "target_bits must be <= start_bits ({start})",
                            self.target_bits, start=self.start_bits)
        return self


class WeightQuantizationGroup(CompressionGroup):
    params: WeightQuantizationParams = Field(default_factory=WeightQuantizationParams)
    """Bit schedule of this group."""


class ActivationQuantizationParams(DSConfigModel):
    """``params`` of an activation-quantization group."""

    bits: int = Field(8, ge=4, le=32)
    """Activation bits (at least 4)."""


class ActivationQuantizationGroup(CompressionGroup):
    params: ActivationQuantizationParams = Field(default_factory=ActivationQuantizationParams)
    """Bits of this group."""


class PruningParams(DSConfigModel):
    """``params`` of a pruning group."""

    dense_ratio: float = Field(0.5, gt=0.0, le=1.0)
    """Fraction of weights (rows, heads, channels) kept."""


class SparsePruningGroup(CompressionGroup):
    params: PruningParams = Field(default_factory=PruningParams)
    """Density of this group."""


class RowPruningGroup(RelatedModulesGroup):
    params: PruningParams = Field(default_factory=PruningParams)
    """Density of this group."""


# ---------------------------------------------------------------- shared parameters


class FP16MixedQuantizeConfig(DSConfigModel):
    """``fp16_mixed_quantize``: blend the FP16 and the quantized value, moving towards fully quantized."""

    enabled: bool = False
    """Enable the blend."""
    quantize_change_ratio: float = Field(0.001, ge=0.0, le=1.0)
    """Initial share of the quantized value; grows to 1."""


class WeightQuantizationShared(DSConfigModel):
    """``weight_quantization.shared_parameters``."""

    enabled: bool = False
    """Enable weight quantization."""
    quantizer_kernel: bool = False
    """Use the DeepSpeed quantization kernel (>= 4 bits; FP16 optimizer only)."""
    schedule_offset: int = Field(0, ge=0)
    """Steps before quantization starts (warm-up)."""
    quantize_groups: int = Field(1, ge=1)
    """Groups per weight matrix, each with its own scale."""
    quantize_verbose: bool = False
    """Log quantization details."""
    quantization_type: Literal["symmetric", "asymmetric"] = "symmetric"
    """Quantization algorithm."""
    rounding: Literal["nearest", "stochastic"] = "nearest"
    """Rounding mode."""
    quantize_weight_in_forward: bool = False
    """Quantize in the forward pass instead of the optimizer step (required for FP32 optimizer training)."""
    fp16_mixed_quantize: FP16MixedQuantizeConfig = Field(default_factory=FP16MixedQuantizeConfig)
    """Blend of FP16 and quantized values."""


class ActivationQuantizationShared(DSConfigModel):
    """``activation_quantization.shared_parameters``."""

    enabled: bool = False
    """Enable activation quantization."""
    quantization_type: Literal["symmetric", "asymmetric"] = "symmetric"
    """Quantization algorithm."""
    range_calibration: Literal["dynamic", "static"] = "static"
    """Dynamic (per token/image) or static (momentum min/max) range for inference."""
    schedule_offset: int = Field(0, ge=0)
    """Steps before quantization starts (warm-up)."""


class SparsePruningShared(DSConfigModel):
    """``sparse_pruning.shared_parameters``."""

    enabled: bool = False
    """Enable sparse pruning."""
    schedule_offset: int = Field(0, ge=0)
    """Steps before pruning starts (warm-up)."""
    schedule_offset_end: int = Field(0, ge=0)
    """Step at which pruning stops (snip_momentum)."""
    schedule_offset_stride: int = Field(1, ge=1)
    """Steps between two pruning updates (snip_momentum)."""
    method: Literal["l1", "topk", "snip_momentum"] = "l1"
    """l1 (static, magnitude), topk (dynamic, learnable) or snip_momentum (structured)."""
    block_pattern: str = "4x1"
    """Structured block pattern ``NxM`` or ``N:M`` (snip_momentum)."""
    dense_ratio: float = Field(0.1, gt=0.0, le=1.0)
    """Target global density (snip_momentum)."""
    excluded_modules: list[str] = Field(default_factory=list)
    """Modules never pruned (e.g. the output layer)."""

    @field_validator("block_pattern")
    @classmethod
    def _pattern(cls, value: str) -> str:
        if not _BLOCK_PATTERN.match(value):
            raise ValueError("block_pattern must look like 'NxM' or 'N:M' with integers N, M (e.g. '4x1', '2:4')")
        return value

    @model_validator(mode="after")
    def _window(self) -> SparsePruningShared:
        if self.enabled and self.method == "snip_momentum" and self.schedule_offset_end < self.schedule_offset:
            raise _error_at(("schedule_offset_end",), "snip_momentum prunes from schedule_offset "
                            "({start}) to schedule_offset_end: the end must not come before the start",
                            self.schedule_offset_end, start=self.schedule_offset)
        return self


class RowPruningShared(DSConfigModel):
    """``row_pruning.shared_parameters`` (also the shape of ``channel_pruning``'s)."""

    enabled: bool = False
    """Enable this pruning."""
    schedule_offset: int = Field(0, ge=0)
    """Steps before pruning starts (warm-up)."""
    method: Literal["l1", "topk"] = "l1"
    """l1 (static, magnitude) or topk (dynamic, learnable)."""


class HeadPruningShared(DSConfigModel):
    """``head_pruning.shared_parameters``."""

    enabled: bool = False
    """Enable head pruning."""
    schedule_offset: int = Field(0, ge=0)
    """Steps before pruning starts (warm-up)."""
    method: Literal["topk"] = "topk"
    """Only topk (dynamic, learnable) is supported."""
    num_heads: int | None = Field(None, ge=1)
    """Attention heads of the model (required when enabled)."""

    @model_validator(mode="after")
    def _heads_known(self) -> HeadPruningShared:
        if self.enabled and self.num_heads is None:
            raise _error_at(("num_heads",), "'num_heads' is required when head pruning is enabled")
        return self


# ---------------------------------------------------------------- techniques


class _Technique(DSConfigModel):
    """Common check, DeepSpeed's: an enabled technique names its ``different_groups`` (snip_momentum picks its own
    modules). An empty ``{}`` is accepted as DeepSpeed accepts it, with a warning: it compresses nothing."""

    def _check_groups(self) -> None:
        shared = self.shared_parameters
        if not shared.enabled or self.different_groups or getattr(shared, "method", "") == "snip_momentum":
            return
        if "different_groups" not in self.model_fields_set:
            raise _error_at(("different_groups",), "the technique is enabled, so different_groups must be "
                            "given (group name -> params and modules)", _MISSING)
        warnings.warn(f"compression_training: {type(self).__name__} is enabled with an empty different_groups, so "
                      "it compresses no module (DeepSpeed accepts this too)", UserWarning, stacklevel=2)

    @model_validator(mode="after")
    def _groups_when_enabled(self) -> _Technique:
        self._check_groups()
        return self


class WeightQuantizationConfig(_Technique):
    """``compression_training.weight_quantization``."""

    shared_parameters: WeightQuantizationShared = Field(default_factory=WeightQuantizationShared)
    """Parameters shared by all groups."""
    different_groups: dict[str, WeightQuantizationGroup] = Field(default_factory=dict)
    """Group name -> bit schedule and modules."""


class ActivationQuantizationConfig(_Technique):
    """``compression_training.activation_quantization``."""

    shared_parameters: ActivationQuantizationShared = Field(default_factory=ActivationQuantizationShared)
    """Parameters shared by all groups."""
    different_groups: dict[str, ActivationQuantizationGroup] = Field(default_factory=dict)
    """Group name -> bits and modules."""


class SparsePruningConfig(_Technique):
    """``compression_training.sparse_pruning``."""

    shared_parameters: SparsePruningShared = Field(default_factory=SparsePruningShared)
    """Parameters shared by all groups."""
    different_groups: dict[str, SparsePruningGroup] = Field(default_factory=dict)
    """Group name -> density and modules (may stay empty for snip_momentum)."""


class RowPruningConfig(_Technique):
    """``compression_training.row_pruning``."""

    shared_parameters: RowPruningShared = Field(default_factory=RowPruningShared)
    """Parameters shared by all groups."""
    different_groups: dict[str, RowPruningGroup] = Field(default_factory=dict)
    """Group name -> density, modules and related (column-pruned) modules."""


class HeadPruningConfig(_Technique):
    """``compression_training.head_pruning``."""

    shared_parameters: HeadPruningShared = Field(default_factory=HeadPruningShared)
    """Parameters shared by all groups."""
    different_groups: dict[str, RowPruningGroup] = Field(default_factory=dict)
    """Group name -> density, output-projection modules and their Q/K/V modules."""


class ChannelPruningConfig(_Technique):
    """``compression_training.channel_pruning``."""

    shared_parameters: RowPruningShared = Field(default_factory=RowPruningShared)
    """Parameters shared by all groups."""
    different_groups: dict[str, RowPruningGroup] = Field(default_factory=dict)
    """Group name -> density, Conv2d modules and the modules that follow them."""


class LayerReductionConfig(DSConfigModel):
    """``compression_training.layer_reduction``: keep some layers of a teacher model (for distillation)."""

    enabled: bool = False
    """Enable layer reduction."""
    keep_number_layer: int | None = Field(None, ge=1)
    """Number of layers kept."""
    module_name_prefix: str | None = None
    """Uniform name prefix of the layer modules (e.g. ``bert.encoder.layer``)."""
    teacher_layer: list[int] | None = None
    """Teacher layers whose weights initialize the kept layers; ``keep_number_layer`` entries."""
    other_module_name: list[str] | None = None
    """Other modules whose weights are re-initialized from the teacher (embeddings, pooler, ...)."""

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> LayerReductionConfig:
        if not self.enabled:
            return self
        if self.keep_number_layer is None:
            raise _error_at(("keep_number_layer",), "'keep_number_layer' is required when layer reduction is enabled")
        if self.teacher_layer is not None and len(self.teacher_layer) != self.keep_number_layer:
            raise _error_at(("teacher_layer",), "must list keep_number_layer ({n}) layers, got {m}",
                            self.teacher_layer, n=self.keep_number_layer, m=len(self.teacher_layer))
        if (self.module_name_prefix is None) != (self.teacher_layer is None):
            missing = "teacher_layer" if self.teacher_layer is None else "module_name_prefix"
            raise _error_at((missing,), "module_name_prefix and teacher_layer go together: "
                            "'{key}' is missing", key=missing)
        if self.teacher_layer is None and not self.other_module_name:
            raise _error_at(("teacher_layer",), "layer reduction is enabled but names no layers: give "
                            "module_name_prefix + teacher_layer, or other_module_name")
        return self


class CompressionConfig(DSConfigModel):
    """The ``compression_training`` section (DeepSpeed Compression library)."""

    weight_quantization: WeightQuantizationConfig = Field(default_factory=WeightQuantizationConfig)
    """Quantization-aware training of weights."""
    activation_quantization: ActivationQuantizationConfig = Field(default_factory=ActivationQuantizationConfig)
    """Quantization of activations."""
    sparse_pruning: SparsePruningConfig = Field(default_factory=SparsePruningConfig)
    """Unstructured or block-structured weight pruning."""
    row_pruning: RowPruningConfig = Field(default_factory=RowPruningConfig)
    """Row pruning of the first of two back-to-back linear layers."""
    head_pruning: HeadPruningConfig = Field(default_factory=HeadPruningConfig)
    """Attention-head pruning of the attention output projection."""
    channel_pruning: ChannelPruningConfig = Field(default_factory=ChannelPruningConfig)
    """Output-channel pruning of the first of two back-to-back Conv2d layers."""
    layer_reduction: LayerReductionConfig = Field(default_factory=LayerReductionConfig)
    """Keep a subset of the teacher's layers."""
    shared_parameters: dict[str, Any] | None = None
    """Read by DeepSpeed only as the gate of ``quantize_training``'s eigenvalue settings; no effect here."""
