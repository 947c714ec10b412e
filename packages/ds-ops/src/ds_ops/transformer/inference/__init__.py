"""``deepspeed.ops.transformer.inference``: the inference kernels' configuration (``DeepSpeedInferenceConfig``)
and their elementwise ops (``op_binding``: bias add, bias GeLU/ReLU, residual add, vector add) in torch.

The kernel-injected transformer layers of this package in DeepSpeed (``DeepSpeedTransformerInference``,
``DeepSpeedMoEInference``, the attention/MLP modules and the Triton kernels) belong to inference kernel
injection, which this version does not build; ``init_inference`` shards with AutoTP instead.
"""

from typing import Any

from .config import ActivationFuncType, DeepSpeedInferenceConfig, NormType, TransformerConfig

__all__ = ["ActivationFuncType", "DeepSpeedInferenceConfig", "NormType", "TransformerConfig"]

_KERNEL_INJECTION = ("DeepSpeedTransformerInference", "DeepSpeedMoEInference", "DeepSpeedMoEInferenceConfig")


def __getattr__(name: str) -> Any:
    if name in _KERNEL_INJECTION:
        raise AttributeError(f"deepspeed.ops.transformer.inference.{name} is part of inference kernel injection "
                             "(deepspeed.module_inject.containers), which this version of the modular DeepSpeed "
                             "does not provide yet; init_inference shards with AutoTP instead")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
