"""AutoEP (automatic expert parallelism): Hugging Face MoE blocks found by preset and replaced by expert-parallel
ones, under DeepSpeed's names (``deepspeed.module_inject.auto_ep*`` serve these modules).

``apply_autoep(model, expert_parallel_config)`` validates the section, finds the blocks of a preset
(``mixtral``, ``qwen3_moe``, ``qwen3_5_moe``, ``deepseek_v2``, ``deepseek_v3``, or custom patterns), creates the
``ep_size_<autoep_size>`` expert groups and replaces each block by :class:`AutoEPMoELayer`: a top-k router and
shared experts replicated, experts sharded over ``autoep_size`` ranks as grouped weights, tokens exchanged
dropless by all-to-all. Modules: ``spec`` (data), ``presets`` and ``adapters`` (families), ``config`` (parsing and
validation), ``detect`` (``AutoEP``), ``layer`` (``AutoEPMoELayer``).
"""

from ds_moe.autoep._apply import apply_autoep, as_autoep_config, remap_parameters
from ds_moe.autoep.config import parse_autoep_config, validate_autoep_config, validate_autoep_post_detection
from ds_moe.autoep.detect import AutoEP
from ds_moe.autoep.layer import AutoEPMoELayer, SplitPlan, combine_from_routed, compute_split_plan
from ds_moe.autoep.presets import PRESET_MODELS
from ds_moe.autoep.spec import AutoEPConfig, MoELayerSpec, MoEModelPreset

__all__ = [
    "PRESET_MODELS",
    "AutoEP",
    "AutoEPConfig",
    "AutoEPMoELayer",
    "MoELayerSpec",
    "MoEModelPreset",
    "SplitPlan",
    "apply_autoep",
    "as_autoep_config",
    "combine_from_routed",
    "compute_split_plan",
    "parse_autoep_config",
    "remap_parameters",
    "validate_autoep_config",
    "validate_autoep_post_detection",
]
