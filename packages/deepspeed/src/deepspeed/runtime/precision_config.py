"""DeepSpeed's precision config models (``deepspeed.runtime.precision_config``), served by the typed ``fp16`` and
``bf16`` sections of ``ds_config``: ``DeepSpeedFP16Config`` is ``ds_config.FP16Config`` and
``DeepSpeedBF16Config`` is ``ds_config.BF16Config`` (the same classes, with the schema's validation and
documented defaults)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from ds_config import BF16Config, DeprecatedConfigWarning, FP16Config, validate_section

__all__ = [
    "BFLOAT16",
    "BFLOAT16_FORMAT",
    "BFLOAT16_OLD",
    "DeepSpeedBF16Config",
    "DeepSpeedFP16Config",
    "FP16",
    "FP16_FORMAT",
    "get_bfloat16_config",
    "get_float16_config",
]

DeepSpeedFP16Config = FP16Config
DeepSpeedBF16Config = BF16Config

BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"  # the older name, still accepted
FP16 = "fp16"

BFLOAT16_FORMAT = """
BFLOAT16 parameters should be of the format:
"bf16": {
  "enabled": true,
  "immediate_grad_update": false,
  "check_grad_overflow": true
}
"""

FP16_FORMAT = """
FP16 parameters should be of the format:
"fp16": {
  "enabled": true,
  "auto_cast": false,
  "loss_scale": 0,
  "initial_scale_power": 32,
  "loss_scale_window": 1000,
  "hysteresis": 2,
  "consecutive_hysteresis": false,
  "min_loss_scale": 1000
}
"""


def get_float16_config(param_dict: Mapping[str, Any]) -> FP16Config:
    """The ``fp16`` section of a config dict, validated (``ConfigError`` naming ``fp16.<key>`` when wrong)."""
    return validate_section(FP16Config, param_dict.get(FP16) or {}, path=FP16)


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> BF16Config:
    """The ``bf16`` section (or its older name ``bfloat16``) of a config dict, validated."""
    if param_dict.get(BFLOAT16) is not None:
        return validate_section(BF16Config, param_dict[BFLOAT16], path=BFLOAT16)
    if param_dict.get(BFLOAT16_OLD) is not None:
        warnings.warn(f"config key '{BFLOAT16_OLD}' is deprecated; use '{BFLOAT16}' instead",
                      DeprecatedConfigWarning, stacklevel=2)
        return validate_section(BF16Config, param_dict[BFLOAT16_OLD], path=BFLOAT16_OLD)
    return BF16Config()
