"""AutoEP's built-in presets: where each model family keeps its MoE block, router, experts and shared experts.

A preset names module *patterns*, not classes: a block matches when its dotted name fully matches
``moe_layer_pattern`` and it has a ``router`` child and an ``experts`` child holding fused 3-D expert weights
(``gate_up_proj`` ``[E, 2 * ffn, hidden]``, ``down_proj`` ``[E, hidden, ffn]``), the layout of Transformers 5.
``hf_classes`` are the Transformers classes the preset was written against, per ``model_type``: they are looked
up (lazily) only to tell a user whose Transformers build lacks them which preset and version is at fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SharedKind = Literal["none", "gated", "residual"]


@dataclass(frozen=True)
class MoEModelPreset:
    """How one model family lays out its MoE blocks (names as in the Hugging Face modeling code)."""

    name: str
    moe_layer_pattern: str
    """Regular expression the block's dotted module name must fully match."""
    num_experts_attr: str
    """``model.config`` attribute holding the routed-expert count (cross-checked against the weights)."""
    hf_model_types: tuple[str, ...]
    """``model.config.model_type`` values this preset covers."""
    hf_classes: dict[str, tuple[str, ...]]
    """model_type -> (block, router, experts) class names in ``transformers.models.<dir>.modeling_<dir>``."""
    router_pattern: str = "gate"
    experts_pattern: str = "experts"
    top_k_attr: str = "num_experts_per_tok"
    shared_experts_pattern: str = ""
    """Child holding the always-on shared expert MLP ('' when the family has none)."""
    shared_experts_gate_pattern: str = ""
    """Child whose sigmoid scales the shared expert's output (Qwen2/3.5-MoE); '' when added as is."""
    jitter_attr: str = ""
    """Block attribute holding the multiplicative input jitter applied in training (Mixtral); '' for none."""
    min_transformers_version: str = "5.0.0"
    unsupported_hf_model_type_notes: dict[str, str] = field(default_factory=dict)

    def shared_kind(self) -> SharedKind:
        if not self.shared_experts_pattern:
            return "none"
        return "gated" if self.shared_experts_gate_pattern else "residual"


_LAYERS = r"model\.layers\.\d+\.mlp"

PRESET_MODELS: dict[str, MoEModelPreset] = {
    "mixtral": MoEModelPreset(
        name="mixtral", moe_layer_pattern=_LAYERS, num_experts_attr="num_local_experts",
        hf_model_types=("mixtral",),
        hf_classes={"mixtral": ("MixtralSparseMoeBlock", "MixtralTopKRouter", "MixtralExperts")},
        jitter_attr="jitter_noise"),
    "qwen3_moe": MoEModelPreset(
        name="qwen3_moe", moe_layer_pattern=_LAYERS, num_experts_attr="num_experts",
        hf_model_types=("qwen3_moe", "qwen2_moe"),
        hf_classes={"qwen3_moe": ("Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", "Qwen3MoeExperts"),
                    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter", "Qwen2MoeExperts")},
        shared_experts_pattern="shared_expert", shared_experts_gate_pattern="shared_expert_gate"),
    "qwen3_5_moe": MoEModelPreset(
        name="qwen3_5_moe", moe_layer_pattern=_LAYERS, num_experts_attr="num_experts",
        hf_model_types=("qwen3_5_moe_text",),
        hf_classes={"qwen3_5_moe_text": ("Qwen3_5MoeSparseMoeBlock", "Qwen3_5MoeTopKRouter", "Qwen3_5MoeExperts")},
        shared_experts_pattern="shared_expert", shared_experts_gate_pattern="shared_expert_gate",
        min_transformers_version="5.2.0",
        unsupported_hf_model_type_notes={
            "qwen3_5_moe": "AutoEP supports the Qwen3.5 text backbone: pass the text-backbone model/config with "
                           "model_type='qwen3_5_moe_text'."}),
    "deepseek_v2": MoEModelPreset(
        name="deepseek_v2", moe_layer_pattern=_LAYERS, num_experts_attr="n_routed_experts",
        hf_model_types=("deepseek_v2",),
        hf_classes={"deepseek_v2": ("DeepseekV2Moe", "DeepseekV2TopkRouter", "DeepseekV2Experts")},
        shared_experts_pattern="shared_experts"),
    "deepseek_v3": MoEModelPreset(
        name="deepseek_v3", moe_layer_pattern=_LAYERS, num_experts_attr="n_routed_experts",
        hf_model_types=("deepseek_v3",),
        hf_classes={"deepseek_v3": ("DeepseekV3MoE", "DeepseekV3TopkRouter", "DeepseekV3Experts")},
        shared_experts_pattern="shared_experts"),
}

# Where a model_type's modeling code lives when the directory name differs from the model_type.
HF_MODULE_DIRS = {"qwen3_5_moe_text": "qwen3_5_moe"}


def preset_for_model_type(model_type: str | None) -> MoEModelPreset | None:
    """The preset covering ``model.config.model_type`` (None when no preset does)."""
    for preset in PRESET_MODELS.values():
        if model_type in preset.hf_model_types:
            return preset
    return None


def preset_noting_model_type(model_type: str | None) -> MoEModelPreset | None:
    """The preset that knows ``model_type`` as an unsupported variant of its family (None otherwise)."""
    for preset in PRESET_MODELS.values():
        if model_type in preset.unsupported_hf_model_type_notes:
            return preset
    return None
