"""The ``compression_training`` section as the compression library reads it: one typed ``CompressionConfig``
(ds-config's schema, so bad values are ``ConfigError``s naming their full key path) from whatever a caller
holds: a config dict or JSON path, a ``DeepSpeedConfig`` (ours or the typed one), or the section itself.
"""

from __future__ import annotations

from typing import Any

from ds_config import CompressionConfig, read_source, validate_section

SECTION = "compression_training"
TECHNIQUES = ("weight_quantization", "activation_quantization", "sparse_pruning", "row_pruning", "head_pruning",
              "channel_pruning")
"""The techniques that change layers, in the order ``redundancy_clean`` bakes them in (DeepSpeed's order)."""


def get_compression_config(param_dict: Any) -> CompressionConfig:
    """The typed ``compression_training`` section of ``param_dict`` (all techniques off when it has none)."""
    if isinstance(param_dict, CompressionConfig):
        return param_dict
    typed = getattr(param_dict, "typed_config", param_dict)  # deepspeed.runtime.config.DeepSpeedConfig
    section = getattr(typed, SECTION, None)
    if isinstance(section, CompressionConfig):
        return section
    if param_dict is None:
        raise TypeError("deepspeed_config is required: a config dict, a path to a JSON config, or a DeepSpeedConfig")
    raw = read_source(param_dict)
    return validate_section(CompressionConfig, raw.get(SECTION), path=SECTION)


def any_technique_enabled(config: CompressionConfig) -> bool:
    """True when some technique that converts layers is on (layer reduction alone needs a teacher, not layers)."""
    return any(getattr(config, name).shared_parameters.enabled for name in TECHNIQUES)


def merged_parameters(config: CompressionConfig, technique: str, group: Any) -> dict[str, Any]:
    """A group's ``params`` merged with the technique's ``shared_parameters``. The group's values win where both
    have a key (sparse pruning's shared ``dense_ratio`` belongs to snip_momentum; a group's is its own)."""
    shared = getattr(config, technique).shared_parameters.model_dump()
    return {**shared, **group.params.model_dump()}
