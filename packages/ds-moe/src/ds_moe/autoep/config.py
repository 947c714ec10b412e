"""The ``expert_parallel`` section: parsing, validation before and after detection, defaults from ``model.config``
(DeepSpeed's ``deepspeed.module_inject.auto_ep_config``).

``validate_autoep_config`` checks the section against the run's topology (``world_size = pp * stage``, the
expert width ``autoep_size * expert_tensor_parallel_size`` must tile a stage) before any group exists;
``validate_autoep_post_detection`` checks it against each detected layer (experts divisible by ``autoep_size``,
group-limited routing consistent).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ds_moe.autoep.folding import build_folding_spec, validate_folding_global
from ds_moe.autoep.presets import PRESET_MODELS, available_preset_names, resolve_autoep_config_defaults
from ds_moe.autoep.spec import (
    _UNSET,
    AutoEPConfig,
    MoELayerSpec,
    MoEModelPreset,
    _raise_unsupported_load_balance_coeff,
)

__all__ = ["_UNSET", "PRESET_MODELS", "AutoEPConfig", "MoELayerSpec", "MoEModelPreset", "fill_autoep_config_from_hf",
           "parse_autoep_config", "resolve_autoep_config_defaults", "validate_autoep_config",
           "validate_autoep_post_detection"]

logger = logging.getLogger(__name__)

_CHOICES = {"score_apply": ("auto", "pre", "post"), "combine_impl": ("auto", "weighted_sum", "legacy_bmm"),
            "score_func": ("auto", "softmax", "sigmoid")}
# keys copied as given (default when absent); expert_w3 and load_balance_coeff distinguish absent from null
_PLAIN_KEYS = {"enabled": False, "autoep_size": 1, "expert_tensor_parallel_size": 1, "validate_folding_routing": False,
               "preset_model": None, "moe_layer_pattern": None, "expert_pattern": None, "router_pattern": None,
               "use_grouped_mm": True, "disable_triton_grouped_mm": False, "route_norm": None, "route_scale": 1.0,
               "score_apply": "auto", "combine_impl": "auto", "num_expert_groups": None, "num_limited_groups": None,
               "score_func": "auto", "top_k": "auto", "routed_scaling_factor": "auto", "expert_w1": None,
               "expert_w2": None, "num_experts_attr": None, "top_k_attr": None, "has_shared_experts": None,
               "shared_experts_pattern": None, "shared_experts_gate_pattern": None}
# names of child modules / weights / config attributes: plain attribute names, never dotted paths
_ATTR_NAME_KEYS = ("expert_w1", "expert_w2", "num_experts_attr", "top_k_attr", "router_pattern", "expert_pattern",
                   "shared_experts_pattern", "shared_experts_gate_pattern")


def parse_autoep_config(param_dict: dict[str, Any] | None) -> AutoEPConfig:
    """``AutoEPConfig`` from the ``expert_parallel`` dict (empty or None: disabled). A non-null
    ``load_balance_coeff`` is refused here already."""
    if not param_dict:
        return AutoEPConfig()
    values = {key: param_dict.get(key, default) for key, default in _PLAIN_KEYS.items()}
    if "expert_w3" in param_dict:
        values["expert_w3"] = param_dict["expert_w3"]  # None: fused gate+up; a name: a separate up weight
    if "load_balance_coeff" in param_dict:
        if param_dict["load_balance_coeff"] is not None:
            _raise_unsupported_load_balance_coeff(param_dict["load_balance_coeff"])
        values["load_balance_coeff"] = None  # explicitly null: a preset's default does not apply
    return AutoEPConfig(**values)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_autoep_config(config: AutoEPConfig, world_size: int, pp_size: int, tp_size: int, sp_size: int, *,
                           zero_stage: int = 0, deepcompile_enabled: bool = False,
                           tp_preset_model: str | None = None, use_data_before_expert_parallel: bool = False,
                           mpu: Any = None, zero_offload_optimizer: bool = False,
                           zero_offload_param: bool = False) -> None:
    """Raise ``ValueError`` naming the key when the section is inconsistent or does not fit the topology.
    ``tp_size > 1`` means AutoEP folded onto AutoTP (``ds_moe.autoep.folding``): the keyword arguments are the
    run's features that folding refuses (ZeRO-3, offload, DeepCompile, data-before-expert rank order, ...)."""
    if config.load_balance_coeff is not None:
        _raise_unsupported_load_balance_coeff(config.load_balance_coeff)
    if not isinstance(config.validate_folding_routing, bool):
        raise ValueError(f"expert_parallel.validate_folding_routing must be a boolean, got "
                         f"{config.validate_folding_routing!r}")
    if not config.enabled:
        return
    tp_size = max(tp_size, 1)
    spec = build_folding_spec(world_size=world_size, pp_size=pp_size, tp_size=tp_size, ep_size=config.autoep_size,
                              etp_size=config.expert_tensor_parallel_size, mp_mode="tp" if tp_size > 1 else "sp")
    validate_folding_global(spec, zero_stage=zero_stage, sp_size=sp_size, deepcompile_enabled=deepcompile_enabled,
                            use_data_before_expert_parallel=use_data_before_expert_parallel, mpu=mpu,
                            tp_preset=tp_preset_model, ep_preset=config.preset_model,
                            zero_offload_optimizer=zero_offload_optimizer, zero_offload_param=zero_offload_param)
    if config.preset_model is not None and config.preset_model not in PRESET_MODELS:
        raise ValueError(f"expert_parallel.preset_model: unknown preset '{config.preset_model}'; available presets: "
                         f"{list(available_preset_names())}")
    for key, allowed in _CHOICES.items():
        if getattr(config, key) not in allowed:
            raise ValueError(f"expert_parallel.{key} must be one of {allowed}, got {getattr(config, key)!r}")
    for key in ("num_expert_groups", "num_limited_groups"):
        value = getattr(config, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"expert_parallel.{key} must be an integer >= 1, got {value!r}")
    if None not in (config.num_expert_groups, config.num_limited_groups) and \
            config.num_limited_groups > config.num_expert_groups:
        raise ValueError(f"expert_parallel.num_limited_groups ({config.num_limited_groups}) must be <= "
                         f"num_expert_groups ({config.num_expert_groups})")
    names = {key: getattr(config, key) for key in _ATTR_NAME_KEYS}
    if config.expert_w3 is not _UNSET and config.expert_w3 is not None:
        names["expert_w3"] = config.expert_w3
    for key, value in names.items():
        if value is not None and (not isinstance(value, str) or not value or "." in value):
            raise ValueError(f"expert_parallel.{key} must be a non-empty attribute name without dots, got {value!r}")
    if config.has_shared_experts is not None and not isinstance(config.has_shared_experts, bool):
        raise ValueError(f"expert_parallel.has_shared_experts must be a boolean, got {config.has_shared_experts!r}")
    factor = config.routed_scaling_factor
    if factor != "auto" and (isinstance(factor, bool) or not isinstance(factor, (int, float))):
        raise ValueError(f"expert_parallel.routed_scaling_factor must be a number or 'auto', got {factor!r}")
    if config.autoep_size == 1:
        logger.warning("AutoEP: autoep_size=1: every rank keeps all experts; layers are replaced, no all-to-all runs")
    if config.shared_experts_pattern and config.has_shared_experts is not True:
        logger.warning("AutoEP: shared_experts_pattern is ignored unless has_shared_experts is true")


def validate_autoep_post_detection(config: AutoEPConfig, specs: list[MoELayerSpec]) -> None:
    """Check ``autoep_size`` and group-limited routing against every detected layer."""
    if not config.enabled:
        return
    ep = config.autoep_size
    for spec in specs:
        where = f"layer '{spec.moe_module_name}'"
        if ep > spec.num_experts:
            raise ValueError(f"expert_parallel.autoep_size={ep} exceeds num_experts={spec.num_experts} in {where} "
                             f"(each rank owns at least one expert); valid values: {_divisors(spec.num_experts)}")
        if spec.num_experts % ep:
            raise ValueError(f"num_experts={spec.num_experts} in {where} is not divisible by expert_parallel."
                             f"autoep_size={ep}; valid values: {_divisors(spec.num_experts)}")
        groups = spec.num_expert_groups if spec.num_expert_groups is not None else config.num_expert_groups
        limited = spec.num_limited_groups if spec.num_limited_groups is not None else config.num_limited_groups
        if groups is None:
            if limited is not None:
                raise ValueError(f"expert_parallel.num_limited_groups needs num_expert_groups in {where}")
            continue
        if groups < 1 or spec.num_experts % groups:
            raise ValueError(f"expert_parallel.num_expert_groups={groups} must be >= 1 and divide num_experts="
                             f"{spec.num_experts} in {where}")
        if limited is None or not 1 <= limited <= groups:
            raise ValueError(f"expert_parallel.num_limited_groups={limited} must be set, >= 1 and <= "
                             f"num_expert_groups={groups} in {where}")


def fill_autoep_config_from_hf(config: AutoEPConfig, model_config: Any) -> None:
    """Fill what the user left unset from the Hugging Face config: DeepSeek's ``n_group`` / ``topk_group``
    (group-limited routing) and ``routed_scaling_factor`` (the router's ``route_scale``)."""
    if model_config is None:
        return
    if config.num_expert_groups is None:
        config.num_expert_groups = getattr(model_config, "n_group", None)
    if config.num_limited_groups is None:
        config.num_limited_groups = getattr(model_config, "topk_group", None)
    if config.routed_scaling_factor == "auto":
        scale = getattr(model_config, "routed_scaling_factor", None)
        if scale is not None:
            config.route_scale = float(scale)


def as_finite_float(value: Any, field_name: str) -> float:
    """``value`` as a float; ``ValueError`` naming ``field_name`` for booleans, strings, NaN and infinities."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{field_name} must be a finite number, got {value!r}")
    return float(value)
