"""``auto_wrap_model_for_sp``: AutoSP's one call for multimodal models.

It wraps every vision-encoder attention layer ``autosp_detector`` recognises in ``UlyssesSPViTAttention`` (with the
CLS-token setting the registry gives its class). Language-decoder attention layers are reported, not wrapped: the
Hugging Face ones take ``hidden_states`` and compute query, key and value inside, while
``DistributedAttention`` needs them from outside; give them sequence parallelism through DeepSpeed's Ulysses
integration (or AutoSP's compiler pass). The vision-to-language projection is reported too: where visual tokens
are spliced into the text changes per architecture, so an ``autosp_fusion`` adapter is attached by hand.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from deepspeed.sequence.autosp_detector import _VIT_HAS_CLS_TOKEN, detect_model_sp_info
from deepspeed.sequence.autosp_vit import UlyssesSPViTAttention

logger = logging.getLogger(__name__)


def auto_wrap_model_for_sp(model: torch.nn.Module, process_group: Any) -> torch.nn.Module:
    """Wrap ``model``'s vision attention layers for sequence parallelism over ``process_group``, in place; returns
    ``model``. Raises ``ValueError`` when it recognises no attention layer at all."""
    info = detect_model_sp_info(model)
    if not info.vit_attn_modules and not info.llm_attn_modules:
        raise ValueError(f"auto_wrap_model_for_sp: found no attention layer AutoSP knows in {type(model).__name__}; "
                         "known classes are listed in deepspeed.sequence.autosp_detector (_VIT_ATTN_CLASSNAMES for "
                         "vision encoders, _LLM_ATTN_CLASSNAMES for language decoders): add the model's class there")
    for name, module in info.vit_attn_modules:
        has_cls = _VIT_HAS_CLS_TOKEN.get(type(module).__name__, True)
        _replace(model, name, UlyssesSPViTAttention(module, process_group, has_cls_token=has_cls))
        logger.debug("AutoSP: %s (%s) wrapped, has_cls_token=%s", name, type(module).__name__, has_cls)
    if info.vit_attn_modules:
        logger.info("AutoSP: wrapped %d vision attention layer(s)", len(info.vit_attn_modules))
    for name, module in info.llm_attn_modules:
        logger.warning("AutoSP: language attention %s (%s) is left as it is: it computes query, key and value from "
                       "hidden_states inside, which DistributedAttention cannot wrap; give the decoder sequence "
                       "parallelism separately", name, type(module).__name__)
    if info.vision_projection_module is not None:
        logger.warning("AutoSP: vision projection %s found; wrap it by hand in the deepspeed.sequence.autosp_fusion "
                       "adapter of the architecture (LLaVA, InternVL, Qwen2-VL) to splice the visual tokens into the "
                       "text and shard the fused sequence", info.vision_projection_module[0])
    return model


def _replace(model: torch.nn.Module, dotted: str, new: torch.nn.Module) -> None:
    *path, last = dotted.split(".")
    parent = model.get_submodule(".".join(path)) if path else model
    setattr(parent, last, new)
