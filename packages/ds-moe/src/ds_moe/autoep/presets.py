"""AutoEP's built-in presets (``mixtral``, ``qwen3_moe``, ``qwen3_5_moe``, ``deepseek_v2``, ``deepseek_v3``), their
adapters, and how a model's presets are chosen (DeepSpeed's ``auto_ep_presets.registry``).

Every family keeps its block at ``model.layers.<i>.mlp`` with a ``gate`` router and an ``experts`` child holding
Transformers 5's fused 3-D weights (``gate_up_proj`` ``[E, 2*ffn, hidden]``, ``down_proj`` ``[E, hidden, ffn]``).
Presets are chosen by ``preset_model``, else by ``model.config.model_type``, else from a custom
``moe_layer_pattern``, else every preset is tried.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from typing import Any

from ds_moe.autoep.adapters import (
    AutoEPPresetAdapter,
    DeepSeekV2PresetAdapter,
    DeepSeekV3PresetAdapter,
    ForwardContract,
    GroupRoutingConfig,
    Qwen35MoePresetAdapter,
    TransformersTopLevelRouterLogitsAdapter,
)
from ds_moe.autoep.spec import _UNSET, AutoEPConfig, MoEModelPreset

__all__ = ["PRESET_MODELS", "AutoEPPresetAdapter", "DeepSeekV2PresetAdapter", "DeepSeekV3PresetAdapter",
           "ForwardContract", "GroupRoutingConfig", "Qwen35MoePresetAdapter", "TransformersTopLevelRouterLogitsAdapter",
           "apply_config_overrides", "available_preset_names", "get_preset", "get_preset_adapter",
           "preset_name_for_hf_model_type", "resolve_autoep_config_defaults", "resolve_preset_candidates",
           "unsupported_preset_for_hf_model_type"]

logger = logging.getLogger(__name__)

_LAYERS = r"model\.layers\.\d+\.mlp"
_FUSED = {"moe_layer_pattern": _LAYERS, "router_pattern": "gate", "experts_pattern": "experts",
          "expert_storage": "fused_3d", "expert_w1": "gate_up_proj", "expert_w2": "down_proj", "expert_w3": None,
          "top_k_attr": "num_experts_per_tok", "score_apply": "post", "gate_bias": False,
          "min_transformers_version": "5.0.0"}
_NO_EXPERT_BIAS = "load_balance_coeff / expert-bias load balancing is not supported; non-null values are rejected."

PRESET_MODELS: dict[str, MoEModelPreset] = {
    "mixtral": MoEModelPreset(**_FUSED, num_experts_attr="num_local_experts", score_func="softmax", route_norm=True,
                              preset_adapter="mixtral", hf_model_types=("mixtral",)),
    "qwen3_moe": MoEModelPreset(
        **_FUSED, num_experts_attr="num_experts", score_func="softmax", route_norm=True, has_shared_experts=True,
        shared_experts_pattern="shared_expert", shared_experts_gate_pattern="shared_expert_gate",
        preset_adapter="qwen3_moe", hf_model_types=("qwen3_moe", "qwen2_moe"),
        docs_support_notes="Also covers Qwen2-MoE with the fused expert layout."),
    "qwen3_5_moe": MoEModelPreset(
        **{**_FUSED, "min_transformers_version": "5.2.0"}, num_experts_attr="num_experts", score_func="softmax",
        route_norm=True, has_shared_experts=True, shared_experts_pattern="shared_expert",
        shared_experts_gate_pattern="shared_expert_gate", preset_adapter="qwen3_5_moe",
        hf_model_types=("qwen3_5_moe_text",),
        unsupported_hf_model_type_notes={
            "qwen3_5_moe": "AutoEP supports the Qwen3.5 text backbone: pass the text-backbone model/config with "
                           "model_type='qwen3_5_moe_text'."},
        docs_support_notes="The Qwen3.5 text backbone (model_type qwen3_5_moe_text)."),
    "deepseek_v2": MoEModelPreset(
        **_FUSED, num_experts_attr="n_routed_experts", score_func="softmax", route_norm=False,
        has_shared_experts=True, shared_experts_pattern="shared_experts",
        autoep_config_defaults={"load_balance_coeff": None}, supports_expert_bias=False,
        preset_adapter="deepseek_v2", hf_model_types=("deepseek_v2",), docs_support_notes=_NO_EXPERT_BIAS),
    "deepseek_v3": MoEModelPreset(
        **_FUSED, num_experts_attr="n_routed_experts", score_func="sigmoid", route_norm=False,
        has_shared_experts=True, shared_experts_pattern="shared_experts",
        autoep_config_defaults={"load_balance_coeff": None}, supports_expert_bias=False,
        preset_adapter="deepseek_v3", hf_model_types=("deepseek_v3",), docs_support_notes=_NO_EXPERT_BIAS),
}

_PRESET_ADAPTERS: dict[str, AutoEPPresetAdapter] = {
    "default": AutoEPPresetAdapter(),
    "mixtral": TransformersTopLevelRouterLogitsAdapter(display_name="Mixtral", hf_model_types=("mixtral",),
                                                       class_name_fragments=("Mixtral",)),
    "qwen3_moe": TransformersTopLevelRouterLogitsAdapter(display_name="Qwen3-MoE/Qwen2-MoE",
                                                         hf_model_types=("qwen3_moe", "qwen2_moe"),
                                                         class_name_fragments=("Qwen3Moe", "Qwen2Moe")),
    "qwen3_5_moe": Qwen35MoePresetAdapter(),
    "deepseek_v2": DeepSeekV2PresetAdapter(),
    "deepseek_v3": DeepSeekV3PresetAdapter(),
}

# preset default -> the AutoEPConfig flag saying the user set that field (then the default does not apply)
_EXPLICIT_FLAGS = {"load_balance_coeff": "_load_balance_coeff_explicit"}


def available_preset_names() -> tuple[str, ...]:
    return tuple(PRESET_MODELS)


def get_preset(preset_name: str) -> MoEModelPreset:
    preset = PRESET_MODELS.get(preset_name)
    if preset is None:
        raise ValueError(f"Unknown preset_model '{preset_name}'. Available presets: {list(available_preset_names())}")
    return preset


def get_preset_adapter(adapter_name: str) -> AutoEPPresetAdapter:
    adapter = _PRESET_ADAPTERS.get(adapter_name)
    if adapter is None:
        raise ValueError(f"Unknown AutoEP preset adapter '{adapter_name}'; registered: {sorted(_PRESET_ADAPTERS)}")
    return adapter


def preset_name_for_hf_model_type(model_type: str | None) -> str | None:
    """The preset covering ``model.config.model_type`` (None when no preset does)."""
    for name, preset in PRESET_MODELS.items():
        if model_type in preset.hf_model_types:
            return name
    return None


def unsupported_preset_for_hf_model_type(model_type: str | None) -> tuple[str, MoEModelPreset] | None:
    """``(name, preset)`` of the preset that knows ``model_type`` as an unsupported variant of its family."""
    for name, preset in PRESET_MODELS.items():
        if model_type in preset.unsupported_hf_model_type_notes:
            return name, preset
    return None


def resolve_autoep_config_defaults(config: AutoEPConfig, preset_name: str | None) -> AutoEPConfig:
    """A copy of ``config`` with the preset's AutoEP defaults for the fields the user did not set."""
    defaults = PRESET_MODELS[preset_name].autoep_config_defaults if preset_name in PRESET_MODELS else {}
    pending = {k: v for k, v in defaults.items() if k in _EXPLICIT_FLAGS and not getattr(config, _EXPLICIT_FLAGS[k])}
    if not pending:
        return config
    resolved = copy.copy(config)
    for key, value in pending.items():
        setattr(resolved, key, value)
    return resolved


_OVERRIDES = (("moe_layer_pattern", "moe_layer_pattern"), ("router_pattern", "router_pattern"),
              ("expert_pattern", "experts_pattern"), ("expert_w1", "expert_w1"), ("expert_w2", "expert_w2"),
              ("num_experts_attr", "num_experts_attr"), ("top_k_attr", "top_k_attr"),
              ("has_shared_experts", "has_shared_experts"), ("shared_experts_pattern", "shared_experts_pattern"),
              ("shared_experts_gate_pattern", "shared_experts_gate_pattern"))


def apply_config_overrides(config: AutoEPConfig, preset: MoEModelPreset) -> MoEModelPreset:
    """``preset`` with the config's explicit overrides (a copy; the registered preset is never changed)."""
    overrides = {field: getattr(config, key) for key, field in _OVERRIDES if getattr(config, key) is not None}
    if config.expert_w3 is not _UNSET:
        overrides["expert_w3"] = config.expert_w3
    return replace(preset, **overrides) if overrides else preset


def _checked(config: AutoEPConfig, name: str, model_config: Any) -> tuple[str, MoEModelPreset]:
    preset = apply_config_overrides(config, get_preset(name))
    get_preset_adapter(preset.preset_adapter).validate_compatibility(name, preset, model_config)
    return name, preset


def resolve_preset_candidates(config: AutoEPConfig, model_config: Any) -> list[tuple[str, MoEModelPreset]]:
    """The ``(name, preset)`` pairs detection tries, in order."""
    if config.preset_model is not None:
        return [_checked(config, config.preset_model, model_config)]
    model_type = getattr(model_config, "model_type", None) if model_config is not None else None
    if model_type:
        name = preset_name_for_hf_model_type(model_type)
        if name is not None:
            logger.info("AutoEP: model_type='%s' selects preset '%s'", model_type, name)
            return [_checked(config, name, model_config)]
        unsupported = unsupported_preset_for_hf_model_type(model_type)
        if unsupported is not None:
            _checked(config, unsupported[0], model_config)  # raises, naming the supported variant
    if config.moe_layer_pattern:
        return [("custom", _custom_preset(config))]
    return [(name, apply_config_overrides(config, preset)) for name, preset in PRESET_MODELS.items()]


def _custom_preset(config: AutoEPConfig) -> MoEModelPreset:
    """A preset from the config's own patterns and routing (Mixtral-like defaults for what it leaves out)."""
    return MoEModelPreset(
        moe_layer_pattern=config.moe_layer_pattern or _LAYERS, router_pattern=config.router_pattern or "gate",
        experts_pattern=config.expert_pattern or "experts", expert_storage="fused_3d",
        expert_w1=config.expert_w1 or "gate_up_proj", expert_w2=config.expert_w2 or "down_proj",
        expert_w3=None if config.expert_w3 is _UNSET else config.expert_w3,
        num_experts_attr=config.num_experts_attr or "num_local_experts",
        top_k_attr=config.top_k_attr or "num_experts_per_tok",
        score_func="softmax" if config.score_func == "auto" else config.score_func,
        score_apply="post" if config.score_apply == "auto" else config.score_apply,
        route_norm=True if config.route_norm is None else bool(config.route_norm), gate_bias=False,
        has_shared_experts=bool(config.has_shared_experts),
        shared_experts_pattern=config.shared_experts_pattern or "",
        shared_experts_gate_pattern=config.shared_experts_gate_pattern or "")
