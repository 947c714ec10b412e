"""``deepspeed.runtime.zero.stage3``: the ZeRO-3 optimizer (``ds_zero.zero3``) and the ZeRO-3 memory estimators."""

from ds_zero.estimate import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from ds_zero.estimate import zero3_model_to_params as model_to_params
from ds_zero.zero3.optimizer import DeepSpeedZeroOptimizer_Stage3

__all__ = [
    "DeepSpeedZeroOptimizer_Stage3",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_to_params",
]
