"""Per-family rules AutoEP's detection cannot read off the module tree: preset adapters.

An adapter checks that the installed Transformers build has the layout a preset was written for, resolves routing
details from ``model.config`` (top-k renormalisation, DeepSeek's group-limited routing), recognises a family's
alternative expert storage (DeepSeek-V3's per-expert ``nn.ModuleList``), and, after a block is replaced, points
Transformers' router-logit output recorders at the new router so ``output_router_logits`` keeps working.
Transformers is imported lazily, only by the checks and the recorder retargeting.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from ds_moe.autoep.spec import (
    _UNSET,
    AutoEPConfig,
    ForwardContract,
    GroupRoutingConfig,
    MoELayerSpec,
    MoEModelPreset,
    _raise_unsupported_load_balance_coeff,
)

__all__ = ["_UNSET", "AutoEPConfig", "AutoEPPresetAdapter", "DeepSeekV2PresetAdapter", "DeepSeekV3PresetAdapter",
           "ForwardContract", "GroupRoutingConfig", "MoELayerSpec", "MoEModelPreset", "Qwen35MoePresetAdapter",
           "TransformersTopLevelRouterLogitsAdapter", "_raise_unsupported_load_balance_coeff"]

RemoveHooks = Callable[[nn.Module], int]


def _version_tuple(version: str) -> tuple[int, ...] | None:
    """Leading numeric release of a version string ('5.2.0.dev0' -> (5, 2, 0)); None when there is none."""
    parts = []
    for piece in version.split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.group() != piece:
            break
    return tuple(parts) or None


class AutoEPPresetAdapter:
    """Rules shared by every preset; subclasses override what their family does differently."""

    def validate_compatibility(self, preset_name: str, preset: MoEModelPreset, model_config: Any) -> None:
        """Raise ``ValueError`` when ``model_config.model_type`` is a variant the preset rejects, or the installed
        Transformers is older than the preset's layout."""
        model_type = getattr(model_config, "model_type", None) if model_config is not None else None
        if model_type is None:
            return
        note = preset.unsupported_hf_model_type_notes.get(model_type)
        if note is not None:
            supported = ", ".join(repr(t) for t in preset.hf_model_types) or "none"
            raise ValueError(f"AutoEP preset '{preset_name}' does not support model_type='{model_type}'. {note} "
                             f"Supported HF model_type value(s): {supported}.")
        self._validate_transformers_version(preset_name, preset, model_type)

    def _validate_transformers_version(self, preset_name: str, preset: MoEModelPreset, model_type: str) -> None:
        minimum = preset.min_transformers_version
        if minimum is None or not self._requires_transformers_version_validation():
            return
        if model_type not in preset.hf_model_types:
            return
        where = f"AutoEP preset '{preset_name}' for model_type='{model_type}' requires Transformers >= {minimum}"
        try:
            installed = self._installed_transformers_version()
        except Exception as exc:  # noqa: BLE001 - any import failure means the layout cannot be checked
            raise ValueError(f"{where}, but transformers could not be imported: {exc}.") from exc
        have, need = _version_tuple(installed), _version_tuple(minimum)
        if have is None or need is None:
            raise ValueError(f"{where}, but the installed Transformers version '{installed}' could not be parsed.")
        if have < need:
            raise ValueError(f"{where}, but installed transformers=={installed}. Upgrade Transformers or choose a "
                             "preset/model combination the installed Transformers supports.")

    def _installed_transformers_version(self) -> str:
        import transformers

        return str(getattr(transformers, "__version__", "unknown"))

    def _requires_transformers_version_validation(self) -> bool:
        return False

    def resolve_route_norm(self, config: AutoEPConfig, preset: MoEModelPreset, model_config: Any) -> bool:
        """Renormalise the top-k scores? The config's ``route_norm``, else ``model.config.norm_topk_prob``, else
        the preset's."""
        if config.route_norm is not None:
            return bool(config.route_norm)
        from_model = getattr(model_config, "norm_topk_prob", None)
        return bool(from_model) if from_model is not None else preset.route_norm

    def resolve_group_routing(self, config: AutoEPConfig, model_config: Any) -> GroupRoutingConfig:
        return GroupRoutingConfig(config.num_expert_groups, config.num_limited_groups)

    def resolve_expert_layout(self, experts_module: nn.Module, preset: MoEModelPreset) -> MoEModelPreset:
        return preset

    def adjust_forward_contract(self, contract: ForwardContract) -> ForwardContract:
        return contract

    def retarget_transformers_output_recorders(self, model: nn.Module, spec: MoELayerSpec, replacement: nn.Module,
                                               retargeted_keys: set[str], remove_hooks: RemoveHooks) -> None:
        """Point Transformers' ``router_logits`` recorders at the replacement (nothing to do by default)."""


def _retarget_router_logits(model: nn.Module, matches: Callable[[nn.Module], bool], make_recorder: Callable[[Any], Any],
                            remove_hooks: RemoveHooks) -> int:
    """Give every module ``matches`` accepts a ``_can_record_outputs`` whose ``router_logits`` entry is
    ``make_recorder(OutputRecorder)``, and reinstall Transformers' capture hooks from them. Returns how many
    modules were retargeted (0 when this Transformers has no output recorders)."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return 0
    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    install = getattr(output_capturing, "maybe_install_capturing_hooks", None)
    if not isinstance(registry, dict) or not callable(install):
        return 0
    entries: dict[str, dict[str, Any]] = {}
    for module in model.modules():
        if not matches(module):
            continue
        key = str(module.__class__)
        own = getattr(module, "_can_record_outputs", None)
        base = own if isinstance(own, dict) else dict.get(registry, key)
        if not isinstance(base, dict) or "router_logits" not in base:
            continue
        outputs = {**base, "router_logits": make_recorder(output_capturing.OutputRecorder)}
        module._can_record_outputs = outputs
        entries[key] = outputs
    if not entries:
        return 0
    # hooks are installed once per model from the class registry: drop the old ones, install from the
    # retargeted entries, then give the registry its class-wide entries back (other models are untouched)
    remove_hooks(model)
    for module in model.modules():
        if hasattr(module, "_output_capturing_hooks_installed"):
            module._output_capturing_hooks_installed = False
    model._output_capturing_hooks_installed = False
    # dict-level access: Transformers' registry subclasses dict with get/__setitem__ taking a model, not a key
    saved = {key: dict.get(registry, key, _UNSET) for key in entries}
    try:
        dict.update(registry, entries)
        install(model)
    finally:
        for key, value in saved.items():
            if value is _UNSET:
                dict.pop(registry, key, None)
            else:
                dict.__setitem__(registry, key, value)
    return len(entries)


def _model_matcher(model_types: tuple[str, ...], fragments: tuple[str, ...]) -> Callable[[nn.Module], bool]:
    def matches(module: nn.Module) -> bool:
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        return model_type in model_types or any(f in type(module).__name__ for f in fragments)
    return matches


class TransformersTopLevelRouterLogitsAdapter(AutoEPPresetAdapter):
    """Families whose Transformers model records ``router_logits`` from its router's first output: after the
    replacement the raw gate logits come from the AutoEP router's ``gate`` linear."""

    def __init__(self, *, display_name: str, hf_model_types: tuple[str, ...],
                 class_name_fragments: tuple[str, ...]) -> None:
        self.display_name = display_name
        self.hf_model_types = hf_model_types
        self.class_name_fragments = class_name_fragments

    def adjust_forward_contract(self, contract: ForwardContract) -> ForwardContract:
        return replace(contract, return_router_logits=False, capture_target="router", capture_index=0,
                       router_logits_capture_mode="raw")

    def retarget_transformers_output_recorders(self, model: nn.Module, spec: MoELayerSpec, replacement: nn.Module,
                                               retargeted_keys: set[str], remove_hooks: RemoveHooks) -> None:
        gate = getattr(getattr(replacement, "router", None), "gate", None)
        if gate is None:
            return
        _retarget_router_logits(
            model, _model_matcher(self.hf_model_types, self.class_name_fragments),
            lambda recorder: recorder(type(gate), index=0, layer_name="router.gate"), remove_hooks)


class Qwen35MoePresetAdapter(TransformersTopLevelRouterLogitsAdapter):
    """Qwen3.5-MoE (the text backbone). Transformers builds that record ``router_logits`` from the router record
    the raw gate logits, as Mixtral's; builds that record them from the sparse block's second output get them
    from the AutoEP layer, which then returns ``(output, router probabilities)``."""

    def __init__(self) -> None:
        super().__init__(display_name="Qwen3.5-MoE", hf_model_types=("qwen3_5_moe_text",),
                         class_name_fragments=("Qwen3_5Moe",))

    def _requires_transformers_version_validation(self) -> bool:
        return True

    def retarget_transformers_output_recorders(self, model: nn.Module, spec: MoELayerSpec, replacement: nn.Module,
                                               retargeted_keys: set[str], remove_hooks: RemoveHooks) -> None:
        if not _records_block_output(model, self.class_name_fragments):
            super().retarget_transformers_output_recorders(model, spec, replacement, retargeted_keys, remove_hooks)
            return
        replacement.return_router_logits = True
        replacement.router_logits_capture_mode = "post_score"
        layer_class = type(replacement)
        _retarget_router_logits(model, _model_matcher(self.hf_model_types, self.class_name_fragments),
                                lambda recorder: recorder(layer_class, index=1), remove_hooks)


def _records_block_output(model: nn.Module, fragments: tuple[str, ...]) -> bool:
    """Does this Transformers build record ``router_logits`` from a sparse MoE block (not from its router)?"""
    for module in model.modules():
        recorded = getattr(module, "_can_record_outputs", None)
        recorder = recorded.get("router_logits") if isinstance(recorded, dict) else None
        target = getattr(recorder, "target_class", None)
        if target is not None and any(f in type(module).__name__ for f in fragments):
            return "Block" in target.__name__
    return False


def _config_value(value: Any, model_config: Any, attr: str) -> Any:
    return value if value else getattr(model_config, attr, None)


class DeepSeekV2PresetAdapter(TransformersTopLevelRouterLogitsAdapter):
    """DeepSeek-V2: the preset's route_norm (not ``norm_topk_prob``); group-limited routing only for
    ``topk_method='group_limited_greedy'``, groups ranked by their best expert. Router logits are recorded from
    the router, as Mixtral's."""

    def __init__(self) -> None:
        super().__init__(display_name="DeepSeek-V2", hf_model_types=("deepseek_v2",),
                         class_name_fragments=("DeepseekV2",))

    def _requires_transformers_version_validation(self) -> bool:
        return True

    def resolve_route_norm(self, config: AutoEPConfig, preset: MoEModelPreset, model_config: Any) -> bool:
        return bool(config.route_norm) if config.route_norm is not None else preset.route_norm

    def resolve_group_routing(self, config: AutoEPConfig, model_config: Any) -> GroupRoutingConfig:
        base = super().resolve_group_routing(config, model_config)
        if getattr(model_config, "topk_method", None) != "group_limited_greedy":
            return base
        return GroupRoutingConfig(_config_value(base.num_expert_groups, model_config, "n_group"),
                                  _config_value(base.num_limited_groups, model_config, "topk_group"), "max")


class DeepSeekV3PresetAdapter(TransformersTopLevelRouterLogitsAdapter):
    """DeepSeek-V3: group-limited routing from ``n_group`` / ``topk_group``; older Transformers keep the experts
    as an ``nn.ModuleList`` of ``gate_proj`` / ``up_proj`` / ``down_proj`` MLPs. Router logits are recorded from
    the router, as Mixtral's."""

    def __init__(self) -> None:
        super().__init__(display_name="DeepSeek-V3", hf_model_types=("deepseek_v3",),
                         class_name_fragments=("DeepseekV3",))

    def _requires_transformers_version_validation(self) -> bool:
        return True

    def resolve_group_routing(self, config: AutoEPConfig, model_config: Any) -> GroupRoutingConfig:
        base = super().resolve_group_routing(config, model_config)
        return GroupRoutingConfig(_config_value(base.num_expert_groups, model_config, "n_group"),
                                  _config_value(base.num_limited_groups, model_config, "topk_group"),
                                  base.group_score_func)

    def resolve_expert_layout(self, experts_module: nn.Module, preset: MoEModelPreset) -> MoEModelPreset:
        if not isinstance(experts_module, nn.ModuleList) or len(experts_module) == 0:
            return preset
        fused_default = (preset.expert_storage, preset.expert_w1, preset.expert_w2, preset.expert_w3) == (
            "fused_3d", "gate_up_proj", "down_proj", None)
        first = experts_module[0]
        if not fused_default or not all(_has_projection(first, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return preset
        return replace(preset, expert_storage="module_list", expert_w1="gate_proj", expert_w2="down_proj",
                       expert_w3="up_proj")


def _has_projection(expert: nn.Module, name: str) -> bool:
    projection = getattr(expert, name, None)
    return projection is not None and (isinstance(projection, nn.Parameter) or hasattr(projection, "weight"))
