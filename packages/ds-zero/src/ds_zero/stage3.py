"""``deepspeed.runtime.zero.stage3``: the ZeRO-3 memory estimators (ZeRO-3 itself comes with its own issue)."""

from ds_zero.estimate import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from ds_zero.estimate import zero3_model_to_params as model_to_params

__all__ = [
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_to_params",
]
