"""``_init_group_wise_weight_quantization(model, ds_config)``: replace the ``nn.Linear`` / ``nn.Embedding``
layers named by ``ds_config["weight_quantization"]["post_init_quant"]`` (``{name fragment: quantization config}``)
with their quantized versions (``layers``). Each layer matches at most one fragment."""

from __future__ import annotations

import logging

from torch import nn

from ds_inference.group_quant import layers
from ds_inference.group_quant.layers import QUANTIZATION_LAYER_MAPPINGS
from ds_inference.group_quant.utils import recursive_setattr

logger = logging.getLogger(__name__)


def _post_init_configs(ds_config: dict) -> dict:
    section = ds_config.get("weight_quantization") if isinstance(ds_config, dict) else None
    if not isinstance(section, dict) or not isinstance(section.get("post_init_quant"), dict):
        raise ValueError("group-wise weight quantization needs ds_config['weight_quantization']['post_init_quant'] "
                         "= {module name fragment: {num_bits, group_size, group_dim, symmetric}}")
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if stage == 3:
        raise ValueError("weight_quantization.post_init_quant with zero_optimization.stage 3 (quantizing partitioned "
                         "parameters) is not built in this version; quantize a model that is not partitioned")
    return section["post_init_quant"]


def _init_group_wise_weight_quantization(model: nn.Module, ds_config: dict) -> nn.Module:
    """Quantize ``model``'s matching layers in place (returns ``model``); smaller weights first."""
    configs = _post_init_configs(ds_config)
    candidates = [(name, m) for name, m in model.named_modules() if type(m) in QUANTIZATION_LAYER_MAPPINGS]
    candidates.sort(key=lambda item: item[1].weight.numel())
    converted: dict[str, list[str]] = {}
    try:
        for name, module in candidates:
            keys = [key for key in configs if key in name]
            if len(keys) > 1:
                raise ValueError(f"module {name!r} matches several weight_quantization.post_init_quant keys: {keys}")
            if keys:
                recursive_setattr(model, name, QUANTIZATION_LAYER_MAPPINGS[type(module)](configs[keys[0]], module))
                converted.setdefault(keys[0], []).append(name)
    finally:
        layers.quantized_weight_registry.clear()
    logger.info("group-wise weight quantization: %d module(s) converted: %s",
                sum(map(len, converted.values())), converted)
    return model
