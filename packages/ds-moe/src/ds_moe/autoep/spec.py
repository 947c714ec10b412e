"""AutoEP's data: the user's ``expert_parallel`` settings, a model family's preset, a detected layer's spec.

DeepSpeed's names and fields (``deepspeed.module_inject.auto_ep_presets.base``): ``AutoEPConfig`` (the parsed
``expert_parallel`` section), ``MoEModelPreset`` (where a family keeps router, experts and shared experts, and its
routing defaults), ``MoELayerSpec`` (one detected block, everything the replacement layer needs), and the two
small results a preset adapter resolves (``GroupRoutingConfig``, ``ForwardContract``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

_UNSET: Any = object()
"""``expert_w3`` / ``load_balance_coeff`` not given (``None`` given means something: fused gate+up / disabled)."""

ExpertStorage = Literal["fused_3d", "module_list"]


def _raise_unsupported_load_balance_coeff(value: object) -> NoReturn:
    raise ValueError(f"expert_parallel.load_balance_coeff={value!r} is not supported: expert_bias (auxiliary-loss-"
                     "free) load balancing is not built in this AutoEP. Set load_balance_coeff to null or omit "
                     "the key.")


@dataclass
class MoEModelPreset:
    """How one model family lays out its MoE blocks (names are the Hugging Face modeling code's)."""

    moe_layer_pattern: str
    """Regular expression the block's dotted module name must fully match."""
    router_pattern: str
    experts_pattern: str
    expert_storage: ExpertStorage
    expert_w1: str
    expert_w2: str
    expert_w3: str | None
    """``None``: ``expert_w1`` holds gate and up fused."""
    num_experts_attr: str
    top_k_attr: str
    score_func: Literal["softmax", "sigmoid"]
    score_apply: Literal["pre", "post"]
    route_norm: bool
    gate_bias: bool
    has_shared_experts: bool = False
    shared_experts_pattern: str = ""
    shared_experts_gate_pattern: str = ""
    autoep_config_defaults: dict[str, Any] = field(default_factory=dict)
    supports_expert_bias: bool = True
    unsupported_router_bias_names: tuple[str, ...] = ()
    preset_adapter: str = "default"
    hf_model_types: tuple[str, ...] = ()
    unsupported_hf_model_type_notes: dict[str, str] = field(default_factory=dict)
    min_transformers_version: str | None = None
    validated_transformers_versions: str = ""
    docs_support_notes: str = ""


@dataclass
class MoELayerSpec:
    """One detected MoE block."""

    moe_module_name: str
    model_family: str
    router_name: str
    experts_name: str
    expert_storage: ExpertStorage
    expert_w1_name: str
    expert_w2_name: str
    expert_w3_name: str | None
    num_experts: int
    top_k: int
    hidden_size: int
    ffn_hidden_size: int
    score_func: Literal["softmax", "sigmoid"]
    score_apply: Literal["pre", "post"]
    route_norm: bool
    gate_bias: bool
    return_router_logits: bool
    router_logits_capture_target: Literal["moe_block", "router", "none"]
    router_logits_capture_index: int | None
    router_logits_capture_layer_name: str | None
    has_shared_experts: bool
    shared_experts_name: str
    shared_experts_gate_name: str = ""
    route_scale: float = 1.0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    group_score_func: Literal["max", "top2_sum"] = "top2_sum"
    supports_expert_bias: bool = True
    unsupported_router_bias_names: tuple[str, ...] = ()
    preset_adapter: str = "default"
    router_logits_capture_mode: Literal["raw", "post_score"] = "post_score"
    moe_output_shape: Literal["batched", "flat"] = "batched"


@dataclass
class AutoEPConfig:
    """The ``expert_parallel`` section, as AutoEP reads it (``parse_autoep_config`` builds it from a dict)."""

    enabled: bool = False
    autoep_size: int = 1
    expert_tensor_parallel_size: int = 1
    validate_folding_routing: bool = False
    preset_model: str | None = None
    moe_layer_pattern: str | None = None
    expert_pattern: str | None = None
    router_pattern: str | None = None
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    route_norm: bool | None = None
    route_scale: float = 1.0
    score_apply: Literal["auto", "pre", "post"] = "auto"
    combine_impl: Literal["auto", "weighted_sum", "legacy_bmm"] = "auto"
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    score_func: Literal["auto", "softmax", "sigmoid"] = "auto"
    top_k: int | str = "auto"
    load_balance_coeff: Any = _UNSET
    routed_scaling_factor: float | str = "auto"
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: Any = _UNSET
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None
    _load_balance_coeff_explicit: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        # remember whether the user named load_balance_coeff: a preset default applies only when they did not
        self._load_balance_coeff_explicit = self.load_balance_coeff is not _UNSET
        if self.load_balance_coeff is _UNSET:
            self.load_balance_coeff = None


@dataclass(frozen=True)
class GroupRoutingConfig:
    """Group-limited (node-limited) routing: experts in ``num_expert_groups`` groups, tokens pick among the best
    ``num_limited_groups`` groups, ranked by ``group_score_func``."""

    num_expert_groups: int | None
    num_limited_groups: int | None
    group_score_func: Literal["max", "top2_sum"] = "top2_sum"


@dataclass(frozen=True)
class ForwardContract:
    """What the replaced block's callers expect back: router logits returned and/or captured by Transformers'
    output recorders (on the block or on the router), and the output's shape."""

    return_router_logits: bool = False
    capture_target: Literal["moe_block", "router", "none"] = "none"
    capture_index: int | None = None
    capture_layer_name: str | None = None
    router_logits_capture_mode: Literal["raw", "post_score"] = "post_score"
    moe_output_shape: Literal["batched", "flat"] = "batched"
