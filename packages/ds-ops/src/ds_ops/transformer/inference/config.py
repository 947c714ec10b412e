"""``DeepSpeedInferenceConfig``: the settings DeepSpeed's inference kernels read (DeepSpeed's argument names and
defaults), and the activation / normalisation kinds (``deepspeed.utils.types``'s enums)."""

from __future__ import annotations

import json
from enum import IntEnum
from typing import Any

import torch


class ActivationFuncType(IntEnum):
    UNKNOWN = 0
    GELU = 1
    ReLU = 2
    GATED_GELU = 3
    GATED_SILU = 4


class NormType(IntEnum):
    UNKNOWN = 0
    LayerNorm = 1
    GroupNorm = 2
    RMSNorm = 3


class TransformerConfig:
    """The layer geometry shared by the transformer configs (``layer_id`` is set per layer, -1 until then)."""

    def __init__(self, hidden_size: int, intermediate_size: int, heads: int, num_hidden_layers: int) -> None:
        self.layer_id = -1
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.heads = heads
        self.num_hidden_layers = num_hidden_layers


_DEFAULTS: dict[str, Any] = dict(
    layer_norm_eps=1e-12, local_rank=-1, mp_size=1, dtype=torch.float16, pre_layer_norm=True,
    norm_type=NormType.LayerNorm, stochastic_mode=False, scale_attention=True, triangular_masking=True,
    local_attention=False, window_size=256, rotary_dim=-1, rotate_half=False, rotate_every_two=True,
    return_tuple=True, mlp_after_attn=True, mlp_act_func_type=ActivationFuncType.GELU, training_mp_size=1,
    bigscience_bloom=False, max_out_tokens=1024, min_out_tokens=1, enable_qkv_quantization=False, use_mup=False,
    scale_attn_by_inverse_layer_idx=False, return_single_tuple=False, set_empty_params=False,
    transposed_mode=False, use_triton=False, triton_autotune=False, num_kv=-1, rope_theta=10000, invert_mask=True)


class DeepSpeedInferenceConfig(TransformerConfig):
    """Inference-kernel settings. ``intermediate_size`` <= 0 means 4 x ``hidden_size``; ``layer_norm_eps`` is kept
    as ``epsilon``; every other keyword (DeepSpeed's list, see ``_DEFAULTS``) becomes the attribute of its name.
    ``dtype`` selects the kernels' precision (fp16 by default, as in DeepSpeed)."""

    def __init__(self, hidden_size: int = -1, intermediate_size: int = -1, heads: int = -1,
                 num_hidden_layers: int = -1, **settings: Any) -> None:
        unknown = sorted(set(settings) - set(_DEFAULTS))
        if unknown:
            raise TypeError(f"DeepSpeedInferenceConfig: unknown argument(s) {unknown}; accepted: hidden_size, "
                            f"intermediate_size, heads, num_hidden_layers, {', '.join(_DEFAULTS)}")
        super().__init__(hidden_size, intermediate_size if intermediate_size > 0 else 4 * hidden_size, heads,
                         num_hidden_layers)
        values = {**_DEFAULTS, **settings}
        self.epsilon = values.pop("layer_norm_eps")
        for name, value in values.items():
            setattr(self, name, value)

    @classmethod
    def from_dict(cls, json_object: dict[str, Any]) -> DeepSpeedInferenceConfig:
        """Defaults overridden by ``json_object``'s entries, set as attributes as they are (DeepSpeed's rule)."""
        config = cls()
        config.__dict__.update(json_object)
        return config

    @classmethod
    def from_json_file(cls, json_file: str) -> DeepSpeedInferenceConfig:
        with open(json_file, encoding="utf-8") as reader:
            return cls.from_dict(json.load(reader))
