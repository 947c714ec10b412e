"""``AutoEP``: find a model's MoE blocks (``ep_parser``) and replace them (``replace_moe_layer``) — DeepSpeed's
``deepspeed.module_inject.auto_ep``.

A block matches a preset when its dotted name fully matches ``moe_layer_pattern`` and it has the router child and
an experts child with expert weights (fused 3-D tensors or an ``nn.ModuleList``); a matching name without them (a
dense MLP layer) is skipped. Sizes come from the weights (ZeRO-3 partitioned ones by their ``ds_shape``) and are
cross-checked against ``model.config``; routing settings come from the config, ``model.config`` and the preset.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from ds_moe.autoep.adapters import AutoEPPresetAdapter
from ds_moe.autoep.config import as_finite_float, fill_autoep_config_from_hf
from ds_moe.autoep.layer import AutoEPMoELayer
from ds_moe.autoep.presets import (
    get_preset_adapter,
    preset_name_for_hf_model_type,
    resolve_preset_candidates,
    unsupported_preset_for_hf_model_type,
)
from ds_moe.autoep.spec import AutoEPConfig, ExpertStorage, ForwardContract, MoELayerSpec, MoEModelPreset
from ds_moe.fused_expert_layout import classify_fused_gate_up_layout

__all__ = ["AutoEP", "_resolve_route_scale", "remove_transformers_output_capture_hooks"]

logger = logging.getLogger(__name__)


def _shape(param: Any) -> torch.Size:
    """A parameter's full shape (ZeRO-3 partitioned ones hold an empty tensor and record it in ``ds_shape``)."""
    return torch.Size(param.ds_shape) if hasattr(param, "ds_id") else torch.Size(param.shape)


def _has_3d(module: nn.Module, name: str) -> bool:
    param = getattr(module, name, None)
    return isinstance(param, torch.Tensor) and len(_shape(param)) == 3


def _storage(experts: nn.Module, preset: MoEModelPreset) -> ExpertStorage:
    if _has_3d(experts, preset.expert_w1):
        return "fused_3d"
    if isinstance(experts, nn.ModuleList):
        return "module_list"
    if any(len(_shape(p)) == 3 for p in experts.parameters(recurse=False)):
        return "fused_3d"
    return "module_list"


def _sizes(experts: nn.Module, preset: MoEModelPreset, storage: ExpertStorage) -> tuple[int, int]:
    """``(hidden_size, ffn_hidden_size)`` from the expert weights; ``ValueError`` when they do not say."""
    if storage == "fused_3d":
        w1, w2 = getattr(experts, preset.expert_w1, None), getattr(experts, preset.expert_w2, None)
        if w1 is not None and w2 is not None:
            if preset.expert_w3 is not None:
                if getattr(experts, preset.expert_w3, None) is None:
                    raise ValueError(f"expert_w3='{preset.expert_w3}' is set but the experts module has no such "
                                     "weight")
                return _shape(w1)[2], _shape(w1)[1]
            layout = classify_fused_gate_up_layout(tuple(_shape(w1)), tuple(_shape(w2)))
            if layout is None:
                raise ValueError(f"expert_w3=None expects fused gate+up weights [E, 2*ffn, hidden] with [E, hidden, "
                                 f"ffn] (or [E, hidden, 2*ffn] with [E, ffn, hidden]); got {preset.expert_w1}="
                                 f"{tuple(_shape(w1))}, {preset.expert_w2}={tuple(_shape(w2))}")
            return layout.hidden_size, layout.ffn_hidden_size
    elif isinstance(experts, nn.ModuleList) and len(experts):
        w1 = getattr(experts[0], preset.expert_w1, None)
        w1 = getattr(w1, "weight", w1)
        if isinstance(w1, torch.Tensor) and len(_shape(w1)) == 2:
            return _shape(w1)[1], _shape(w1)[0]
    raise ValueError(f"cannot infer hidden_size/ffn_hidden_size from experts with storage={storage}, "
                     f"expert_w1='{preset.expert_w1}'")


def _resolve_route_scale(config: AutoEPConfig, model_config: Any) -> float:
    """The router's one output scale: the config's ``routed_scaling_factor``, else ``model.config``'s, else
    ``route_scale``."""
    factor = config.routed_scaling_factor
    if factor != "auto":
        scale = as_finite_float(factor, "expert_parallel.routed_scaling_factor")
    elif getattr(model_config, "routed_scaling_factor", None) is not None:
        factor = model_config.routed_scaling_factor
        scale = as_finite_float(factor, "model.config.routed_scaling_factor")
    else:
        return as_finite_float(config.route_scale, "expert_parallel.route_scale")
    if config.route_scale != 1.0 and config.route_scale != scale:
        logger.warning("AutoEP: routed_scaling_factor=%s overrides route_scale=%s", factor, config.route_scale)
    return scale


def _forward_contract(block: nn.Module, router: nn.Module) -> ForwardContract:
    """How Transformers captures this block's router logits: on the router class, or from the block's output."""
    target, index, layer_name, returns = "none", None, None, False
    recorded = getattr(type(router), "_can_record_outputs", None)
    if recorded is not None:
        target, index = "router", 0
        for value in (recorded.values() if isinstance(recorded, dict) else ()):
            if isinstance(value, dict):
                index, layer_name = value.get("index", 0), value.get("layer_name")
    recorded = getattr(block, "_can_record_outputs", None)
    if recorded:
        target, returns = "moe_block", True
        for value in (recorded.values() if isinstance(recorded, dict) else ()):
            if isinstance(value, dict):
                index = value.get("index")
            elif isinstance(value, int):
                index = value
    return ForwardContract(return_router_logits=returns, capture_target=target, capture_index=index,
                           capture_layer_name=layer_name)


def remove_transformers_output_capture_hooks(model: nn.Module) -> int:
    """Remove Transformers' output-capturing forward hooks (reinstalled after the conversion); how many."""
    removed = 0
    for module in model.modules():
        for hook_id, hook in list(getattr(module, "_forward_hooks", {}).items()):
            if getattr(hook, "__name__", "") != "output_capturing_hook":
                continue
            del module._forward_hooks[hook_id]
            getattr(module, "_forward_hooks_with_kwargs", {}).pop(hook_id, None)
            getattr(module, "_forward_hooks_always_called", {}).pop(hook_id, None)
            removed += 1
    return removed


class AutoEP:
    """Detect (``ep_parser``) and replace (``replace_moe_layer(s)``) a model's MoE blocks. Fills routing defaults
    the user left unset from ``model.config`` (DeepSeek's groups and scaling factor) into ``config``."""

    def __init__(self, model: nn.Module, config: AutoEPConfig) -> None:
        self.model = model
        self.config = config
        self.model_config = getattr(model, "config", None)
        self._retargeted_transformers_output_recorders: set[str] = set()
        fill_autoep_config_from_hf(self.config, self.model_config)

    def _resolve_presets(self) -> list[tuple[str, MoEModelPreset]]:
        return resolve_preset_candidates(self.config, self.model_config)

    def _requires_selected_preset_detection(self) -> bool:
        """Finding nothing is an error when the user chose a preset or pattern, or the model type is known."""
        if self.config.preset_model is not None or self.config.moe_layer_pattern is not None:
            return True
        model_type = getattr(self.model_config, "model_type", None)
        return model_type is not None and (preset_name_for_hf_model_type(model_type) is not None
                                           or unsupported_preset_for_hf_model_type(model_type) is not None)

    def ep_parser(self) -> list[MoELayerSpec]:
        """A spec per MoE block of the model (blocks already replaced are not matched again)."""
        candidates = self._resolve_presets()
        specs: list[MoELayerSpec] = []
        for preset_name, preset in candidates:
            adapter = get_preset_adapter(preset.preset_adapter)
            pattern = re.compile(preset.moe_layer_pattern)
            for name, module in self.model.named_modules():
                if pattern.fullmatch(name) and not getattr(module, "_is_autoep_layer", False):
                    spec = self._layer_spec(name, module, preset_name, preset, adapter)
                    if spec is not None:
                        specs.append(spec)
        if not specs and any(getattr(m, "_is_autoep_layer", False) for m in self.model.modules()):
            return []  # converted before: nothing left to replace
        if not specs:
            if self._requires_selected_preset_detection():
                self._raise_no_moe_layers_detected(candidates)
            logger.warning("AutoEP: no MoE layers detected in the model")
        duplicates = sorted({s.moe_module_name for s in specs if sum(t.moe_module_name == s.moe_module_name
                                                                     for t in specs) > 1})
        if duplicates:
            raise ValueError(f"AutoEP detection is ambiguous: module(s) {duplicates} match several presets; set "
                             "expert_parallel.preset_model or custom patterns so each matches exactly one")
        return specs

    def _layer_spec(self, name: str, block: nn.Module, preset_name: str, preset: MoEModelPreset,
                    adapter: AutoEPPresetAdapter) -> MoELayerSpec | None:
        experts = getattr(block, preset.experts_pattern, None)
        if experts is None:
            return None  # a dense MLP where the pattern matched
        layout = adapter.resolve_expert_layout(experts, preset)
        if not (isinstance(experts, nn.ModuleList) or _has_3d(experts, layout.expert_w1)):
            return None
        router = getattr(block, preset.router_pattern, None)
        if router is None:
            return None
        storage = _storage(experts, layout)
        config, model_config = self.config, self.model_config
        num_experts = getattr(model_config, preset.num_experts_attr, None)
        top_k = getattr(model_config, preset.top_k_attr, None)
        weight = getattr(router, "weight", None)
        weight_shape = _shape(weight) if isinstance(weight, torch.Tensor) else None
        if weight_shape is not None and len(weight_shape) == 2:
            if num_experts is not None and num_experts != weight_shape[0]:
                raise ValueError(f"model.config.{preset.num_experts_attr}={num_experts} does not match the router "
                                 f"weight {tuple(weight_shape)} of layer '{name}'")
            num_experts = weight_shape[0]
        if num_experts is None:
            raise ValueError(f"cannot determine num_experts of layer '{name}': set model.config."
                             f"{preset.num_experts_attr} or use a preset")
        if isinstance(config.top_k, int) and not isinstance(config.top_k, bool):
            top_k = config.top_k
        elif top_k is None:
            raise ValueError(f"cannot determine top_k of layer '{name}': set model.config.{preset.top_k_attr} or "
                             "expert_parallel.top_k")
        try:
            hidden, ffn = _sizes(experts, layout, storage)
        except ValueError as exc:
            if self._requires_selected_preset_detection():
                raise ValueError(f"AutoEP: preset '{preset_name}' matched layer '{name}', but {exc}") from exc
            logger.warning("AutoEP: skipping %s: %s", name, exc)
            return None
        if weight_shape is not None and len(weight_shape) == 2 and hidden != weight_shape[1]:
            raise ValueError(f"hidden_size={hidden} of the experts of '{name}' does not match the router weight "
                             f"{tuple(weight_shape)}")
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts} in layer '{name}'")
        if config.score_func != "auto":
            score_func = config.score_func
        else:
            from_model = getattr(model_config, "scoring_func", None)
            score_func = from_model if from_model in ("softmax", "sigmoid") else preset.score_func
        groups = adapter.resolve_group_routing(config, model_config)
        contract = adapter.adjust_forward_contract(_forward_contract(block, router))
        shared = preset.shared_experts_pattern if preset.has_shared_experts and preset.shared_experts_pattern \
            and getattr(block, preset.shared_experts_pattern, None) is not None else ""
        shared_gate = preset.shared_experts_gate_pattern if shared and preset.shared_experts_gate_pattern \
            and getattr(block, preset.shared_experts_gate_pattern, None) is not None else ""
        if getattr(model_config, "router_z_loss_coef", 0.0):
            logger.warning("AutoEP: layer %s: router_z_loss_coef is not implemented by the AutoEP router", name)
        return MoELayerSpec(
            moe_module_name=name, model_family=preset_name, router_name=preset.router_pattern,
            experts_name=preset.experts_pattern, expert_storage=storage, expert_w1_name=layout.expert_w1,
            expert_w2_name=layout.expert_w2, expert_w3_name=layout.expert_w3, num_experts=int(num_experts),
            top_k=int(top_k), hidden_size=int(hidden), ffn_hidden_size=int(ffn), score_func=score_func,
            score_apply=config.score_apply if config.score_apply != "auto" else preset.score_apply,
            route_norm=adapter.resolve_route_norm(config, preset, model_config),
            gate_bias=getattr(router, "bias", None) is not None if weight is not None else preset.gate_bias,
            return_router_logits=contract.return_router_logits,
            router_logits_capture_target=contract.capture_target,
            router_logits_capture_index=contract.capture_index,
            router_logits_capture_layer_name=contract.capture_layer_name, has_shared_experts=bool(shared),
            shared_experts_name=shared, shared_experts_gate_name=shared_gate,
            route_scale=_resolve_route_scale(config, model_config), num_expert_groups=groups.num_expert_groups,
            num_limited_groups=groups.num_limited_groups, group_score_func=groups.group_score_func,
            supports_expert_bias=preset.supports_expert_bias,
            unsupported_router_bias_names=preset.unsupported_router_bias_names, preset_adapter=preset.preset_adapter,
            router_logits_capture_mode=contract.router_logits_capture_mode, moe_output_shape=contract.moe_output_shape)

    def _raise_no_moe_layers_detected(self, candidates: list[tuple[str, MoEModelPreset]]) -> None:
        if self.config.preset_model is not None:
            source = f"preset_model='{self.config.preset_model}'"
        elif self.config.moe_layer_pattern is not None:
            source = f"moe_layer_pattern='{self.config.moe_layer_pattern}'"
        else:
            source = f"model_type='{getattr(self.model_config, 'model_type', None)}'"
        expected = "; ".join(f"{name}: moe_layer_pattern='{p.moe_layer_pattern}', router='{p.router_pattern}', "
                             f"experts='{p.experts_pattern}'" for name, p in candidates)
        raise ValueError(f"AutoEP: no MoE layers detected for {source}. Expected structure: {expected}. The preset "
                         "does not match the model, or the installed Transformers lays the model out differently; "
                         "choose a matching preset, upgrade Transformers, or give custom AutoEP patterns.")

    def _swap(self, spec: MoELayerSpec, ep_size: int, ep_rank: int) -> AutoEPMoELayer:
        parent_name, _, child = spec.moe_module_name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        replacement = AutoEPMoELayer(spec, getattr(parent, child), ep_size, ep_rank, self.config)
        setattr(parent, child, replacement)
        logger.info("AutoEP: replaced '%s' (ep_size=%d, ep_rank=%d, %d local experts)", spec.moe_module_name,
                    ep_size, ep_rank, replacement.num_local_experts)
        return replacement

    def _retarget(self, spec: MoELayerSpec, replacement: nn.Module) -> None:
        get_preset_adapter(spec.preset_adapter).retarget_transformers_output_recorders(
            self.model, spec, replacement, self._retargeted_transformers_output_recorders,
            remove_transformers_output_capture_hooks)

    def replace_moe_layer(self, spec: MoELayerSpec, ep_size: int, ep_rank: int) -> None:
        """Replace one detected block by an :class:`AutoEPMoELayer` (in place)."""
        self._retarget(spec, self._swap(spec, ep_size, ep_rank))

    def replace_moe_layers(self, specs: list[MoELayerSpec], ep_size: int, ep_rank: int) -> None:
        """Replace every block; Transformers' recorders are retargeted once per family and layer class."""
        replaced = [(spec, self._swap(spec, ep_size, ep_rank)) for spec in specs]
        seen: set[tuple[str, str, type]] = set()
        for spec, layer in replaced:
            key = (spec.preset_adapter, spec.model_family, type(layer))
            if key not in seen:
                seen.add(key)
                self._retarget(spec, layer)
