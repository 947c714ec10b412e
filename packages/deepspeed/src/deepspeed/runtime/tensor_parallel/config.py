"""``deepspeed.runtime.tensor_parallel.config``: the Hugging Face tensor-parallel plan of a model.

Hugging Face keeps a model's plan in up to three places: ``config.base_model_tp_plan`` (the base model's layers,
``"layers.*.self_attn.q_proj": "colwise"``), the model class's ``_tp_plan`` (model-level entries such as
``lm_head``) and the instance's ``_tp_plan`` (which ``from_pretrained`` may overwrite with an expanded copy of
the base plan, its keys prefixed ``model.``). :func:`_get_hf_tp_plan` merges the three, in that order, into one
``{pattern: style}`` dict, so an entry only the class has (``lm_head``) is not lost when the instance's plan
replaces the base one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_PREFIX = "model."

__all__ = ["_get_hf_tp_plan"]


def _get_hf_tp_plan(model: Any) -> dict[str, str] | None:
    """The merged tensor-parallel plan of ``model`` (config, class, instance), or None when none has entries.

    A later source's entry for the same pattern replaces an earlier one. A ``model.``-prefixed pattern whose
    unprefixed form is already in the plan is the base plan repeated under the causal-LM wrapper's attribute
    name, and is dropped rather than listed twice.
    """
    config = getattr(model, "config", None)
    sources = (
        getattr(config, "base_model_tp_plan", None) if config is not None else None,
        getattr(type(model), "_tp_plan", None),
        vars(model).get("_tp_plan") if hasattr(model, "__dict__") else None,
    )
    merged: dict[str, str] = {}
    seen: set[str] = set()
    for plan in sources:
        if not isinstance(plan, Mapping):
            continue
        for pattern, style in plan.items():
            prefixed = pattern.startswith(_PREFIX)
            canonical = pattern[len(_PREFIX):] if prefixed else pattern
            if prefixed and canonical in seen:
                continue
            merged[pattern] = style
            seen.add(canonical)
    return merged or None
