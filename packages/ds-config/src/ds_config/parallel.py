"""Training-time automatic parallelism: ``tensor_parallel`` (AutoTP) and ``expert_parallel`` (AutoEP)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from ds_config._base import DSConfigModel
from ds_config._types import Bool, DType, Float, Int, NonNeg, PosInt

AUTOTP_PRESETS = ("llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3")
AUTOEP_PRESETS = ("mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3")


def _preset(accepted: tuple[str, ...], value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in accepted:
        raise ValueError(f"unknown preset; accepted: {', '.join(accepted)}")
    return value.lower()


class LayerSpec(DSConfigModel):
    """One entry of ``tensor_parallel.partition_config.layer_specs``: how matching weights are sharded."""

    patterns: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    """Regular expressions matched against parameter names."""
    partition_type: Literal["row", "column", "skip"]
    """Shard along rows (input dim), columns (output dim), or leave replicated."""
    shape: list[Int | list[PosInt]] | None = None
    """Logical shape of a fused weight, e.g. ``[2, -1]`` or ``[[q, kv, kv], -1]`` (-1: inferred)."""
    partition_dim: NonNeg | None = None
    """Dimension of ``shape`` along which the fused sub-parameters are split."""
    model_types: list[str] | None = None
    """Apply only to these ``model.config.model_type`` values."""
    gather_output: Bool = False
    """Column specs: all-gather the output shards so every rank gets the whole output."""
    grad_allreduce: Bool = False
    """Skip specs: the weight stays whole but sees sharded activations; its gradient is summed over the group."""

    @model_validator(mode="after")
    def _shape(self) -> LayerSpec:
        if self.shape is not None:
            bad = [d for d in self.shape if isinstance(d, int) and d != -1 and d <= 0]
            if bad or sum(1 for d in self.shape if d == -1) > 1:
                raise ValueError("shape entries must be positive sizes, lists of sizes, or a single -1")
            if self.partition_dim is not None and self.partition_dim >= len(self.shape):
                raise ValueError(f"partition_dim {self.partition_dim} is outside shape {self.shape}")
        return self


class PartitionConfig(DSConfigModel):
    """``tensor_parallel.partition_config``: custom regex-based sharding rules."""

    use_default_specs: Bool = False
    """Merge these specs on top of the ``preset_model`` specs."""
    layer_specs: list[LayerSpec] = []
    """Sharding rules, first match wins."""


class TPGroupConfig(DSConfigModel):
    """``tensor_parallel.tp``: tensor-parallel group settings."""

    tp_size: PosInt = 1
    tp_grain_size: PosInt = 1
    """Shard sizes are multiples of this many elements."""
    mpu: Any = Field(None, exclude=True)
    """A Python object (not JSON); AutoTP training takes its groups from ``initialize``'s ``mpu`` instead."""
    tp_group: Any = Field(None, exclude=True)
    """A process group (not JSON); see ``mpu``."""


class TensorParallelConfig(DSConfigModel):
    """``tensor_parallel``: AutoTP training (weights sharded across the tensor-parallel group)."""

    autotp_size: NonNeg = 0
    """Tensor-parallel degree; 0 (or 1) disables AutoTP."""
    preset_model: str | None = None
    """Built-in sharding preset: llama, bloom, chatglm, mixtral, deepseek_v2, qwen2, phi3."""
    partition_config: PartitionConfig | None = None
    """Custom sharding rules (highest priority)."""
    tp_overlap_comm: Bool = False
    """Overlap tensor-parallel communication with computation."""
    dtype: DType = "fp16"
    keep_module_on_host: Bool = False
    """Keep checkpoint weights on the host while sharding."""
    replace_with_kernel_inject: Bool = Field(False, validation_alias=AliasChoices("replace_with_kernel_inject",
                                                                                  "kernel_inject"))
    tp: TPGroupConfig = Field(default_factory=TPGroupConfig,
                              validation_alias=AliasChoices("tp", "tensor_parallel"))
    injection_policy_tuple: Any = Field(None, exclude=True)
    """Kernel-injection policies (Python classes; an inference feature, no effect on AutoTP training)."""

    @field_validator("preset_model", mode="before")
    @classmethod
    def _known_preset(cls, value: Any) -> Any:
        return _preset(AUTOTP_PRESETS, value)

    @property
    def enabled(self) -> bool:
        return self.autotp_size > 1


class ExpertParallelConfig(DSConfigModel):
    """``expert_parallel``: AutoEP (MoE layers of Hugging Face models replaced by expert-parallel ones)."""

    enabled: Bool = False
    """Enable AutoEP."""
    autoep_size: PosInt = 1
    """Expert-parallel degree; must divide every detected layer's expert count (1 keeps experts local)."""
    preset_model: str | None = None
    """Model family: mixtral, qwen3_moe, qwen3_5_moe, deepseek_v2, deepseek_v3."""
    load_balance_coeff: float | None = None
    """Expert-bias (auxiliary-loss-free) load balancing; not supported yet, so only ``null`` is accepted."""
    # DeepSpeed's overrides of preset detection, routing and kernels (ds_moe.autoep.config reads them all)
    expert_tensor_parallel_size: PosInt = 1
    validate_folding_routing: Bool = False
    moe_layer_pattern: str | None = None
    expert_pattern: str | None = None
    router_pattern: str | None = None
    use_grouped_mm: Bool = True
    disable_triton_grouped_mm: Bool = False
    route_norm: Bool | None = None
    route_scale: Float = 1.0
    score_apply: str = "auto"
    combine_impl: str = "auto"
    num_expert_groups: PosInt | None = None
    num_limited_groups: PosInt | None = None
    score_func: str = "auto"
    top_k: PosInt | Literal["auto"] = "auto"
    routed_scaling_factor: Float | Literal["auto"] = "auto"
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: str | None = None
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: Bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None

    @field_validator("preset_model", mode="before")
    @classmethod
    def _known_preset(cls, value: Any) -> Any:
        return _preset(AUTOEP_PRESETS, value)

    @field_validator("load_balance_coeff", mode="before")
    @classmethod
    def _unsupported(cls, value: Any) -> None:
        if value is not None:  # any value, 0 and False included, would ask for expert_bias routing
            raise ValueError(f"load_balance_coeff={value!r} is not supported by AutoEP yet (it would register an "
                             "expert_bias for auxiliary-loss-free load balancing); set load_balance_coeff to null or "
                             "omit the key")
        return value
