"""``deepspeed.module_inject``: AutoTP (automatic tensor parallelism, from ``ds_inference.autotp``) and AutoEP's
layer (``auto_ep_layer``, from ``ds_moe.autoep``).

``replace_transformer_layer`` shards with AutoTP; DeepSpeed's fused inference kernels (kernel injection,
``deepspeed.module_inject.containers``) are not part of this version: asking for them warns and AutoTP runs.
"""

from typing import Any

from deepspeed.compat import not_built_message, submodule_getattr
from ds_inference.autotp import (
    AutoTP,
    AutoTPConfig,
    AutoTPPresets,
    EmbeddingLayer,
    GateUpPack_LinearLayer,
    LinearAllreduce,
    LinearLayer,
    Normalize,
    PartitionType,
    SubParamLinearAllreduce,
    SubParamLinearLayer,
    TPLayerSpec,
    merge_autotp_configs,
    replace_transformer_layer,
    revert_transformer_layer,
    set_autotp_mode,
)

__all__ = ["AutoTP", "AutoTPConfig", "AutoTPPresets", "EmbeddingLayer", "GateUpPack_LinearLayer", "LinearAllreduce",
           "LinearLayer", "Normalize", "PartitionType", "SubParamLinearAllreduce", "SubParamLinearLayer",
           "TPLayerSpec", "merge_autotp_configs", "replace_transformer_layer", "revert_transformer_layer",
           "set_autotp_mode"]

_submodule = submodule_getattr(__name__)
_KERNEL_INJECTION = "inference kernel injection (deepspeed.module_inject.containers)"
# DeepSpeed's kernel-injection names (policies, quantized injection) that this version lacks
_NOT_BUILT_NAMES = ("HFBertLayerPolicy", "DSPolicy", "GroupQuantizer", "ReplaceWithTensorSlicing", "generic_injection",
                    "quantize_transformer_layer")


def __getattr__(name: str) -> Any:
    if name in _NOT_BUILT_NAMES:
        raise AttributeError(not_built_message(f"deepspeed.module_inject.{name}", _KERNEL_INJECTION))
    return _submodule(name)
