"""AutoEP (automatic expert parallelism): Hugging Face MoE blocks found by preset and replaced by expert-parallel ones.

``apply_autoep(model, expert_parallel_config)`` finds the blocks of a preset (``mixtral``, ``qwen3_moe``,
``qwen3_5_moe``, ``deepseek_v2``, ``deepseek_v3``), creates the ``ep_size_<autoep_size>`` expert groups and
replaces each block by :class:`AutoEPMoELayer`: router and shared experts replicated, experts sharded over
``autoep_size`` ranks, tokens exchanged dropless by all-to-all. Transformers is imported only to check a Hugging
Face model's preset against the installed build.
"""

from ds_moe.autoep._apply import apply_autoep, remap_parameters
from ds_moe.autoep._detect import MoELayerSpec, detect_moe_layers, resolve_preset
from ds_moe.autoep._experts import AutoEPExperts, grouped_linear, loop_grouped_linear
from ds_moe.autoep.layer import AutoEPMoELayer
from ds_moe.autoep.presets import PRESET_MODELS, MoEModelPreset

__all__ = [
    "PRESET_MODELS",
    "AutoEPExperts",
    "AutoEPMoELayer",
    "MoELayerSpec",
    "MoEModelPreset",
    "apply_autoep",
    "detect_moe_layers",
    "grouped_linear",
    "loop_grouped_linear",
    "remap_parameters",
    "resolve_preset",
]
