"""Finding a model's MoE blocks: which preset applies, and a validated :class:`MoELayerSpec` per matching block.

A block matches when its dotted name fully matches the preset's ``moe_layer_pattern`` and it has the router and
experts children; a matching name without them (a dense MLP layer, e.g. Qwen3-MoE's ``mlp_only_layers``) is
skipped. Shapes come from the weights and are cross-checked against ``model.config``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ds_config import ConfigError, ConfigProblem, ExpertParallelConfig
from ds_moe.autoep._compat import KEY, check_transformers_support, transformers_version
from ds_moe.autoep.presets import (
    PRESET_MODELS,
    MoEModelPreset,
    preset_for_model_type,
    preset_noting_model_type,
)

# The fused-expert layout AutoEP's experts compute: concatenated [gate; up], no bias, not transposed.
_LAYOUT_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                 "has_post_expert_norm": False}


@dataclass(frozen=True)
class MoELayerSpec:
    """One detected MoE block."""

    name: str  # dotted module name in the model
    preset: str
    num_experts: int
    top_k: int | None
    hidden_size: int
    ffn_hidden_size: int  # per expert
    router_name: str
    experts_name: str
    shared_experts_name: str = ""  # '' when the block has no shared expert
    shared_experts_gate_name: str = ""
    jitter_noise: float = 0.0


def resolve_preset(model: nn.Module, config: ExpertParallelConfig) -> MoEModelPreset:
    """``config.preset_model``'s preset, or the one for ``model.config.model_type``; checks Transformers."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    noted = preset_noting_model_type(model_type)
    if noted is not None and config.preset_model in (None, noted.name):
        raise ConfigError(ConfigProblem(KEY, f"AutoEP preset '{noted.name}' does not support model_type "
                                        f"'{model_type}': {noted.unsupported_hf_model_type_notes[model_type]}",
                                        config.preset_model))
    by_type = preset_for_model_type(model_type)
    if config.preset_model is None:
        if by_type is None:
            raise ConfigError(ConfigProblem(KEY, f"no built-in AutoEP preset covers model_type {model_type!r}; "
                                            f"set it to one of {', '.join(PRESET_MODELS)}", None))
        preset = by_type
    else:
        preset = PRESET_MODELS[config.preset_model]
        if by_type is not None and by_type is not preset:
            raise ConfigError(ConfigProblem(KEY, f"the model's model_type is '{model_type}', which preset "
                                            f"'{by_type.name}' covers", config.preset_model))
    if model_type in preset.hf_model_types:
        check_transformers_support(preset, model_type)
    return preset


def detect_moe_layers(model: nn.Module, preset: MoEModelPreset) -> list[MoELayerSpec]:
    """A spec per MoE block of ``model`` matching ``preset`` (already converted blocks are skipped)."""
    pattern = re.compile(preset.moe_layer_pattern)
    model_config = getattr(model, "config", None)
    specs = []
    for name, module in model.named_modules():
        if not pattern.fullmatch(name) or getattr(module, "_is_autoep_layer", False):
            continue
        router = getattr(module, preset.router_pattern, None)
        experts = getattr(module, preset.experts_pattern, None)
        if router is None or experts is None:
            continue  # a dense MLP in a layer the pattern covers
        specs.append(_spec(name, module, router, experts, preset, model_config))
    return specs


def _layout_problem(preset: MoEModelPreset, name: str, what: str) -> ConfigError:
    version = transformers_version()
    return ConfigError(ConfigProblem(KEY, f"AutoEP preset '{preset.name}' matched '{name}', but {what}; AutoEP "
                                     "needs the fused expert layout (gate_up_proj [E, 2*ffn, hidden], down_proj "
                                     f"[E, hidden, ffn]) of Transformers >= {preset.min_transformers_version} "
                                     f"(installed: {version or 'not importable'})", preset.name))


def _expert_shapes(name: str, experts: nn.Module, preset: MoEModelPreset) -> tuple[int, int, int]:
    """``(num_experts, hidden, ffn)`` of a fused experts module, or a layout error."""
    if isinstance(experts, nn.ModuleList):
        raise _layout_problem(preset, name, f"its '{preset.experts_pattern}' is a per-expert nn.ModuleList")
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3):
        raise _layout_problem(preset, name, "its experts have no 3-D gate_up_proj / down_proj weights")
    num_experts, two_ffn, hidden = gate_up.shape
    if two_ffn % 2 or tuple(down.shape) != (num_experts, hidden, two_ffn // 2):
        raise _layout_problem(preset, name, f"gate_up_proj {tuple(gate_up.shape)} and down_proj "
                                            f"{tuple(down.shape)} do not pair up")
    odd = [f"{flag}={getattr(experts, flag)}" for flag, want in _LAYOUT_FLAGS.items()
           if getattr(experts, flag, want) != want]
    gate_fn = getattr(type(experts), "_apply_gate", None)
    if gate_fn is not None and getattr(gate_fn, "__name__", "") != "_default_apply_gate":
        odd.append("a custom _apply_gate")
    if odd:
        raise _layout_problem(preset, name, f"its experts use {', '.join(odd)}")
    return num_experts, hidden, two_ffn // 2


def _spec(name: str, block: nn.Module, router: nn.Module, experts: nn.Module, preset: MoEModelPreset,
          model_config: Any) -> MoELayerSpec:
    num_experts, hidden, ffn = _expert_shapes(name, experts, preset)
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (num_experts, hidden):
        shape = None if weight is None else tuple(weight.shape)
        raise _layout_problem(preset, name, f"its router '{preset.router_pattern}' weight {shape} is not "
                                            f"[num_experts={num_experts}, hidden={hidden}]")
    from_config = getattr(model_config, preset.num_experts_attr, None)
    if isinstance(from_config, int) and from_config != num_experts:
        raise ConfigError(ConfigProblem(KEY, f"model.config.{preset.num_experts_attr}={from_config} does not match "
                                        f"the {num_experts} experts of '{name}'", preset.name))
    top_k = getattr(router, "top_k", None) or getattr(model_config, preset.top_k_attr, None)
    shared = preset.shared_experts_pattern
    shared = shared if shared and getattr(block, shared, None) is not None else ""
    gate = preset.shared_experts_gate_pattern
    shared_gate = gate if shared and gate and getattr(block, gate, None) is not None else ""
    jitter = float(getattr(block, preset.jitter_attr, 0.0) or 0.0) if preset.jitter_attr else 0.0
    return MoELayerSpec(name=name, preset=preset.name, num_experts=num_experts, top_k=top_k, hidden_size=hidden,
                        ffn_hidden_size=ffn, router_name=preset.router_pattern, experts_name=preset.experts_pattern,
                        shared_experts_name=shared, shared_experts_gate_name=shared_gate, jitter_noise=jitter)
