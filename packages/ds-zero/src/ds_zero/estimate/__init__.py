"""ZeRO memory estimators: model-states memory (params, gradients, Adam states) per GPU and per node.

Standalone: nothing distributed is started, and the ``*_all_cold`` functions need only parameter counts.
The ``*_all_live`` / ``*_all_cold`` functions print DeepSpeed's table and return its rows
(``EstimateRow``: bytes per CPU/node and per GPU for each option combination); the
``estimate_zero*_model_states_mem_needs`` functions return the raw byte figures for one combination.
``hf_config_params`` counts a Hugging Face model from its config on the meta device (needs transformers).
"""

from ds_zero.estimate._count import (
    ParamCounts,
    count_largest_layer_params,
    count_params,
    count_total_params,
)
from ds_zero.estimate._hf import build_meta_model, hf_config_params, load_hf_config
from ds_zero.estimate._table import GIB, EstimateRow, render_table
from ds_zero.estimate._zero2 import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    format_zero2_estimate,
    zero2_estimate_rows,
)
from ds_zero.estimate._zero2 import model_to_params as zero2_model_to_params
from ds_zero.estimate._zero3 import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    format_zero3_estimate,
    zero3_estimate_rows,
)
from ds_zero.estimate._zero3 import model_to_params as zero3_model_to_params
from ds_zero.estimate.cli import parse_count

__all__ = [
    "GIB",
    "EstimateRow",
    "ParamCounts",
    "build_meta_model",
    "count_largest_layer_params",
    "count_params",
    "count_total_params",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "format_zero2_estimate",
    "format_zero3_estimate",
    "hf_config_params",
    "load_hf_config",
    "parse_count",
    "render_table",
    "zero2_estimate_rows",
    "zero2_model_to_params",
    "zero3_estimate_rows",
    "zero3_model_to_params",
]
