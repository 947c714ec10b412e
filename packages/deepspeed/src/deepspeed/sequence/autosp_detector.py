"""Find the attention layers of a multimodal model for AutoSP, by class name.

The registries below name the Hugging Face attention classes AutoSP knows: vision-encoder (ViT) attention, which
``auto_sp.auto_wrap_model_for_sp`` wraps in ``UlyssesSPViTAttention``, and language-decoder attention, which it
reports but leaves alone. Support for another architecture is one more name in a registry.
"""

from __future__ import annotations

import dataclasses

import torch

_VIT_ATTN_CLASSNAMES = {
    "ViTAttention", "CLIPAttention", "SiglipAttention", "InternVisionAttention", "Qwen2VLVisionAttention",
    "Idefics2VisionAttention", "PaliGemmaVisionAttention",
}
"""Vision-encoder attention classes."""

_VIT_HAS_CLS_TOKEN = {
    "ViTAttention": True, "CLIPAttention": True, "SiglipAttention": False, "InternVisionAttention": False,
    "Qwen2VLVisionAttention": False, "Idefics2VisionAttention": False, "PaliGemmaVisionAttention": False,
}
"""Whether the encoder puts a CLS token at position 0 (replicated on every rank, never sharded). A class missing
here is assumed to have one."""

_LLM_ATTN_CLASSNAMES = {
    "LlamaAttention", "MistralAttention", "Qwen2Attention", "InternLM2Attention", "GemmaAttention", "Phi3Attention",
    "GPTNeoXAttention", "FalconAttention", "MptAttention",
}
"""Language-decoder attention classes."""

_VISION_PROJ_KEYWORDS = ("visual_projection", "mm_projector", "vision_proj", "multi_modal_projector",
                         "img_projection")
"""Parts of the module path of the vision-to-language projection."""


@dataclasses.dataclass
class SPModelInfo:
    """What ``detect_model_sp_info`` found: ``(dotted name, module)`` pairs."""

    vit_attn_modules: list[tuple[str, torch.nn.Module]] = dataclasses.field(default_factory=list)
    llm_attn_modules: list[tuple[str, torch.nn.Module]] = dataclasses.field(default_factory=list)
    vision_projection_module: tuple[str, torch.nn.Module] | None = None
    """The outermost module whose path names a vision projection (its submodules match too)."""


def detect_model_sp_info(model: torch.nn.Module) -> SPModelInfo:
    """The vision and language attention layers and the vision projection of ``model``, in module order."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"detect_model_sp_info: model must be an nn.Module, got {type(model).__name__}")
    info = SPModelInfo()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in _VIT_ATTN_CLASSNAMES:
            info.vit_attn_modules.append((name, module))
        elif kind in _LLM_ATTN_CLASSNAMES:
            info.llm_attn_modules.append((name, module))
        if info.vision_projection_module is None and any(word in name for word in _VISION_PROJ_KEYWORDS):
            info.vision_projection_module = (name, module)
    return info
