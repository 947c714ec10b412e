"""``zero_optimization``: ZeRO stages 0-3, offload, ZeRO++, MiCS, leaf modules, ZenFlow.

Serves the documented names of ``deepspeed.runtime.zero.config`` and ``deepspeed.runtime.zero.offload_config``.
Sizes are counts of elements, not bytes. Deprecated keys are accepted (moved to their replacement with a
warning) and left out of dumps, so a dumped config validates again; the deprecated offload switches
(``cpu_offload``, ``cpu_offload_param``) at any stage, ignored with that warning where the stage cannot honour
them. Checks that need the stage live here, so a component handed a ``DeepSpeedZeroConfig`` can trust it:
offload_param, NVMe optimizer offload, ``ratio``, ``super_offload`` and MiCS only with stage 3.
"""

from __future__ import annotations

import logging
import sys
import warnings
from enum import IntEnum
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ds_config._base import Deprecated, DeprecatedConfigWarning
from ds_config._errors import ConfigError, ConfigProblem
from ds_config._typed_section import Bool, Int, NonNegInt, SectionModel, deprecated_field
from ds_config._zenflow import ZenFlowConfig
from ds_config._zero_offload import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
)
from ds_config.unbuilt import InertConfigKeyWarning

__all__ = [
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroLeafModuleConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
    "ZeroStageEnum",
    "ZenFlowConfig",
    "DEFAULT_LEAF_MODULE_CLASSES",
]


class ZeroStageEnum(IntEnum):
    """ZeRO stages: what is partitioned across data-parallel ranks."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


# An alias, not a member of its own: JSON Schema and error messages list each stage once.
ZeroStageEnum.max_stage = ZeroStageEnum.weights


DEFAULT_LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
"""Hugging Face MoE blocks DeepSpeed marks as ZeRO-3 leaf modules by default."""

_LOCO_DEFAULTS = {"err_beta": 0.8, "reset_T": 1024}


def _names(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _check_names(values: list[str]) -> list[str]:
    for i, v in enumerate(values):
        if not v.strip():
            raise ValueError(f"entry {i} is empty; give a class name, module name or name suffix")
    return values


class DeepSpeedZeroLeafModuleConfig(SectionModel):
    """Modules ZeRO-3 treats as leaves: gathered whole, no hooks below (dynamic sub-module use, e.g. MoE)."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    """Bare class names or fully qualified dotted class paths."""

    names: list[str] = Field(default_factory=list)
    """Exact module names as ``model.named_modules()`` yields them."""

    name_suffixes: list[str] = Field(default_factory=list)
    """Suffixes matched against the end of the ``named_modules()`` names."""

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        return _names(value)

    @field_validator("classes", "names", "name_suffixes")
    @classmethod
    def _no_blank_names(cls, value: list[str]) -> list[str]:
        return _check_names(value)


def _on_if_true(value: Any) -> dict | None:
    return {"device": OffloadDeviceEnum.cpu.value} if value else None


class DeepSpeedZeroConfig(SectionModel):
    """Sets parameters for ZeRO optimizations (the ``zero_optimization`` section)."""

    stage: ZeroStageEnum = ZeroStageEnum.disabled
    """0 disabled, 1 optimizer states, 2 + gradients, 3 + parameters partitioned."""

    contiguous_gradients: Bool = True
    """Copy gradients into a contiguous buffer as they are produced (avoids fragmentation)."""

    reduce_scatter: Bool = True
    """Use reduce or reduce-scatter instead of all-reduce to average gradients."""

    reduce_bucket_size: NonNegInt = 500_000_000
    """Elements reduced/all-reduced at a time."""

    use_multi_rank_bucket_allreduce: Bool = True
    """Combine the reduce buckets of different ranks into one all-reduce instead of several reduces."""

    allgather_partitions: Bool = True
    """All-gather (rather than a series of broadcasts) to collect updated parameters after each step."""

    allgather_bucket_size: NonNegInt = 500_000_000
    """Elements all-gathered at a time."""

    overlap_comm: Bool | None = Field(None, validate_default=True)
    """Overlap gradient reduction with the backward pass; unset means on for stage 3, off otherwise."""

    load_from_fp32_weights: Bool = True
    """Initialize fp32 master weights from the checkpoint's fp32 copies (no precision loss)."""

    elastic_checkpoint: Bool = False
    """Load checkpoints saved with a different GPU count (no longer supported)."""

    offload_param: DeepSpeedZeroOffloadParamConfig | None = None
    """Parameter offload to CPU or NVMe; stage 3 only."""

    offload_optimizer: DeepSpeedZeroOffloadOptimizerConfig | None = None
    """Optimizer state offload to CPU or NVMe, optimizer step on CPU; stages 1-3 (NVMe: stage 3)."""

    zenflow: ZenFlowConfig | None = None
    """Enable ZenFlow."""

    sub_group_size: NonNegInt = 1_000_000_000
    """Tile size (elements) for parameter processing in ZeRO-3 offload / ZeRO-Infinity."""

    cpu_offload_param: Annotated[Bool | None, Deprecated(new="offload_param", convert=_on_if_true)] = deprecated_field()
    """Deprecated, please use ``offload_param``."""

    cpu_offload_use_pin_memory: Annotated[
        Bool | None, Deprecated(note="set 'pin_memory' inside 'offload_param' or 'offload_optimizer'")
    ] = deprecated_field()
    """Deprecated, please use ``offload_param`` or ``offload_optimizer``."""

    cpu_offload: Annotated[Bool | None, Deprecated(new="offload_optimizer", convert=_on_if_true)] = deprecated_field()
    """Deprecated, please use ``offload_optimizer``."""

    prefetch_bucket_size: NonNegInt = Field(50_000_000, alias="stage3_prefetch_bucket_size")
    """Maximum parameter elements fetched ahead of use (ZeRO-3)."""

    param_persistence_threshold: NonNegInt = Field(100_000, alias="stage3_param_persistence_threshold")
    """Parameters with fewer elements than this are not partitioned."""

    model_persistence_threshold: NonNegInt = Field(sys.maxsize, alias="stage3_model_persistence_threshold")
    """Upper bound on the elements of all unpartitioned (persistent) parameters."""

    max_live_parameters: NonNegInt = Field(1_000_000_000, alias="stage3_max_live_parameters")
    """Maximum parameter elements resident per GPU before releasing."""

    max_reuse_distance: NonNegInt = Field(1_000_000_000, alias="stage3_max_reuse_distance")
    """Do not release a parameter that will be reused within this many parameter elements."""

    gather_16bit_weights_on_model_save: Bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    """Gather the partitioned weights when ``save_16bit_model()`` saves the model."""

    module_granularity_threshold: NonNegInt = Field(0, alias="stage3_module_granularity_threshold")
    """Modules with parameter_count / (1 + descendants) below this are fetched as one unit."""

    use_all_reduce_for_fetch_params: Bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    """Fetch module parameters with all_reduce instead of all_gather (ZeRO-3)."""

    allgather_sequential: Bool = Field(False, alias="stage3_allgather_sequential")
    """All-gather parameters one at a time, without bucketing (less copying, lower peak memory)."""

    stage3_gather_fp16_weights_on_model_save: Annotated[
        Bool, Deprecated(new="gather_16bit_weights_on_model_save")
    ] = deprecated_field(False)
    """Deprecated, please use ``gather_16bit_weights_on_model_save``."""

    ignore_unused_parameters: Bool = True
    """Tolerate parameters that get no gradient (stage 2)."""

    legacy_stage1: Bool = False
    """Use the old ZeRO stage 1 implementation."""

    round_robin_gradients: Bool = False
    """Stages 1-2 with CPU offload: parallelize gradient copies to CPU across ranks."""

    zero_hpz_partition_size: NonNegInt = 1
    """Ranks in the ZeRO++ hierarchical partitioning (hpZ) secondary group; 1 disables hpZ."""

    zero_quantized_weights: Bool = False
    """ZeRO++: quantize weights for the all-gather."""

    zero_quantized_nontrainable_weights: Bool = False
    """Store non-trainable weights quantized (e.g. frozen base weights under LoRA)."""

    zero_quantized_gradients: Bool = False
    """ZeRO++: quantized gradient all-to-all reduce."""

    zeropp_loco_param: dict[str, Any] | None = None
    """LoCo-ZeRO++ error feedback: ``err_beta`` (0..1, default 0.8) and ``reset_T`` (steps, default 1024)."""

    mics_shard_size: Int = Field(-1, ge=-1)
    """MiCS: devices over which model states are partitioned; -1 disables MiCS."""

    mics_hierarchical_params_gather: Bool = False
    """MiCS: two-stage (intra-node, then inter-node) parameter gather."""

    memory_efficient_linear: Bool = True
    """Memory efficient linear implementation (stage 3)."""

    pipeline_loading_checkpoint: Bool = False
    """Pipeline the loading of checkpoint shards (stage 3)."""

    override_module_apply: Bool = True
    """Override ``nn.Module.apply`` so it sees gathered parameters (stage 3)."""

    log_trace_cache_warnings: Bool = False
    """Log trace cache warnings such as invalidation events."""

    enable_sanity_checks: Bool = False
    """Internal sanity checks, for debugging."""

    save_muon_momentum_buffer_in_memory: Bool = False
    """Muon with ZeRO-3 NVMe offload: keep the momentum buffer in memory instead of swapping it."""

    leaf_module: DeepSpeedZeroLeafModuleConfig = Field(default_factory=DeepSpeedZeroLeafModuleConfig)
    """Modules ZeRO-3 treats as leaf modules."""
    compute_grad_norm: Bool = True
    """DeepSpeed 0.19.8: skip the global gradient norm of stage 1/2 steps when false (validated; the norm is
    always computed here)."""
    parameter_alignment: Bool = False
    """DeepSpeed 0.19.8: 16-byte-align each parameter in stage 1/2 flat buffers (validated; no effect here)."""

    @model_validator(mode="before")
    @classmethod
    def _legacy_forms(cls, data: Any) -> Any:
        # Early configs wrote "zero_optimization": true for stage 1
        if isinstance(data, bool):
            warnings.warn("a boolean 'zero_optimization' is deprecated; use {\"stage\": N}",
                          DeprecatedConfigWarning, stacklevel=2)
            return {"stage": 1 if data else 0}
        if isinstance(data, dict):
            return _legacy_offload(data)
        return data

    @field_validator("stage", mode="before")
    @classmethod
    def _stage_number(cls, value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or value not in (0, 1, 2, 3):
            raise ValueError("must be 0, 1, 2 or 3 (0 disabled, 1 optimizer states, 2 +gradients, 3 +parameters)")
        return value

    @field_validator("overlap_comm")
    @classmethod
    def _overlap_default(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value is None and "stage" in info.data:
            return info.data["stage"] == ZeroStageEnum.weights
        return value

    @field_validator("offload_param")
    @classmethod
    def _param_offload_stage(cls, value: DeepSpeedZeroOffloadParamConfig | None,
                             info: ValidationInfo) -> DeepSpeedZeroOffloadParamConfig | None:
        stage = info.data.get("stage")
        if value is not None and value.enabled and stage is not None and stage != ZeroStageEnum.weights:
            raise ConfigError(ConfigProblem(
                "device", f"parameter offload needs ZeRO stage 3 (stage is {int(stage)}): only stage 3 "
                "partitions parameters; set stage to 3 or device to 'none'", value.device.value))
        return value

    @field_validator("offload_optimizer")
    @classmethod
    def _optimizer_offload_stage(cls, value: DeepSpeedZeroOffloadOptimizerConfig | None,
                                 info: ValidationInfo) -> DeepSpeedZeroOffloadOptimizerConfig | None:
        stage = info.data.get("stage")
        if value is None or not value.enabled or stage is None or stage == ZeroStageEnum.weights:
            return value
        if stage == ZeroStageEnum.disabled:
            raise ConfigError(ConfigProblem(
                "device", "optimizer offload needs ZeRO stage 1, 2 or 3 (stage is 0)", value.device.value))
        if value.device == OffloadDeviceEnum.nvme:  # DeepSpeed's stage 1/2 would silently offload nothing
            raise ConfigError(ConfigProblem("device", f"NVMe optimizer offload needs ZeRO stage 3 (stage is "
                                            f"{int(stage)}); accepted here: 'cpu' or 'none'", value.device.value))
        for key, what, ignored in (("ratio", "partial offload (ratio < 1)", value.ratio != 1.0),
                                   ("super_offload", "super_offload", value.super_offload)):
            if ignored:  # as DeepSpeed: stage 1/2 offload the whole optimizer and ignore these
                warnings.warn(f"config key 'zero_optimization.offload_optimizer.{key}' has no effect with ZeRO "
                              f"stage {int(stage)}: {what} is a stage-3 feature; the whole optimizer is offloaded "
                              "(DeepSpeed ignores it too)", InertConfigKeyWarning, stacklevel=2)
        return value

    @field_validator("zeropp_loco_param")
    @classmethod
    def _loco(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else _check_loco(value)

    @field_validator("mics_shard_size")
    @classmethod
    def _mics_stage(cls, value: int, info: ValidationInfo) -> int:
        stage = info.data.get("stage")
        if value > 0 and stage is not None and stage != ZeroStageEnum.weights:
            raise ValueError(f"MiCS needs ZeRO stage 3 (stage is {int(stage)}); use -1 to disable MiCS")
        return value

    @field_validator("mics_hierarchical_params_gather")
    @classmethod
    def _mics_hierarchical(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("mics_shard_size", 1) <= 0:
            raise ValueError("hierarchical gather is a MiCS option: set mics_shard_size > 0 as well")
        return value

    @model_validator(mode="after")
    def _deprecated_pin_memory(self) -> DeepSpeedZeroConfig:
        # cpu_offload_use_pin_memory applied to the offload sections the deprecated switches turned on
        if self.cpu_offload_use_pin_memory:
            for flag, section in ((self.cpu_offload_param, self.offload_param),
                                  (self.cpu_offload, self.offload_optimizer)):
                if flag and section is not None and not section.pin_memory:
                    section.pin_memory = True
        return self

    @model_validator(mode="after")
    def _elastic_checkpoint_zero3(self) -> DeepSpeedZeroConfig:
        if int(self.stage) == 3 and self.elastic_checkpoint:  # on DeepSpeed's logger, as DeepSpeed says it
            logging.getLogger("DeepSpeed").warning("ZeRO-3 elastic checkpointing is deprecated and no longer "
                                                   "supported. Use Universal Checkpointing instead.")
        return self

    @property
    def offload_param_enabled(self) -> bool:
        """True when parameters are offloaded (to CPU or NVMe)."""
        return self.offload_param is not None and self.offload_param.enabled

    @property
    def offload_optimizer_enabled(self) -> bool:
        """True when optimizer state is offloaded (to CPU or NVMe)."""
        return self.offload_optimizer is not None and self.offload_optimizer.enabled


def _check_loco(value: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(value) - set(_LOCO_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; accepted keys: err_beta, reset_T")
    out = {**_LOCO_DEFAULTS, **value}
    beta, reset = out["err_beta"], out["reset_T"]
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"err_beta must be a number in [0, 1], got {beta!r}")
    if isinstance(reset, float) and reset.is_integer():
        reset = int(reset)
    if isinstance(reset, bool) or not isinstance(reset, int) or reset < 1:
        raise ValueError(f"reset_T must be a positive integer (steps), got {reset!r}")
    return {"err_beta": float(beta), "reset_T": reset}


_LEGACY_OFFLOAD = {
    # deprecated switch -> (its replacement, the stages that honour the replacement, what it offloads)
    "cpu_offload_param": ("offload_param", (3,), "parameter offload applies to ZeRO stage 3 only"),
    "cpu_offload": ("offload_optimizer", (1, 2, 3), "optimizer offload needs ZeRO stage 1, 2 or 3"),
}


def _legacy_offload(data: dict) -> dict:
    """The deprecated offload switches are accepted at every stage, as DeepSpeed accepts them (old configs keep
    ``"cpu_offload": true`` while a launcher flag picks the stage). Where the stage honours the replacement the
    switch migrates to it (``_screen_input``, with the deprecation warning); where it does not, the switch is
    dropped with that warning plus a note that it is ignored at this stage, so the replacement is never turned
    on at a stage that cannot run it (DeepSpeed ignores ``offload_param`` below stage 3 the same way)."""
    stage = data.get("stage", 0)
    if stage == "auto":
        stage = 0  # "auto" means the default stage
    if isinstance(stage, float) and stage.is_integer():
        stage = int(stage)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        return data  # the stage check reports it
    ignored = [key for key, (_, stages, _) in _LEGACY_OFFLOAD.items() if data.get(key) is True and stage not in stages]
    for key in ignored:
        new, _, why = _LEGACY_OFFLOAD[key]
        warnings.warn(f"config key '{key}' is deprecated; use '{new}' instead. It is ignored here: {why} "
                      f"(stage is {stage})", DeprecatedConfigWarning, stacklevel=2)
    return {k: v for k, v in data.items() if k not in ignored} if ignored else data
