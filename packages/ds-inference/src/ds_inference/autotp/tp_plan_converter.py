"""DeepSpeed's ``TPPlanConverter``: a Hugging Face ``tp_plan`` (``{"layers.*.q_proj": "colwise"}``) as AutoTP
layer specs, under DeepSpeed's module path ``deepspeed.module_inject.tp_plan_converter``.

Each entry becomes one :class:`TPLayerSpec` whose regex matches the weight of the named module anywhere in the
model (``*`` matches any run of characters, as in DeepSpeed). ``colwise_gather_output`` (and its older name
``colwise_rep``) gives a column spec with ``gather_output``; ``replicated_with_grad_allreduce`` a skip spec with
``grad_allreduce``. A plan with any other style is rejected whole.
"""

from __future__ import annotations

from collections.abc import Mapping

from ds_inference.autotp._specs import SUPPORTED_STYLES, PartitionType, TPLayerSpec, check_styles, style_spec

__all__ = ["SUPPORTED_STYLES", "PartitionType", "TPPlanConverter"]


class TPPlanConverter:
    """Hugging Face tp_plan -> AutoTP layer specs."""

    @staticmethod
    def convert(hf_tp_plan: Mapping[str, str] | None) -> list[TPLayerSpec] | None:
        """One spec per entry, in the plan's order; None for an empty plan (the caller falls back to AutoTP's
        own rules). Raises ``ValueError`` naming the unsupported styles when any entry's style is not built."""
        if not hf_tp_plan:
            return None
        check_styles(hf_tp_plan)
        specs = []
        for pattern, style in hf_tp_plan.items():
            regex = TPPlanConverter._wildcard_to_regex(pattern)
            regex += "$" if regex.endswith(r"\.weight") else r"\.weight$"
            specs.append(style_spec(regex, style))
        return specs

    @staticmethod
    def _wildcard_to_regex(pattern: str) -> str:
        """``layers.*.q_proj`` -> ``.*layers\\..*\\.q_proj``: dots literal, ``*`` any run, anchored anywhere."""
        return ".*" + pattern.replace(".", r"\.").replace("*", ".*")
