"""``deepspeed.utils.types``: the activation and normalisation kinds the inference kernels take (DeepSpeed's
enums; defined with ``DeepSpeedInferenceConfig`` in ``ds_ops.transformer.inference.config``)."""

from ds_ops.transformer.inference.config import ActivationFuncType, NormType

GATED_ACTIVATION_TYPES = [ActivationFuncType.GATED_GELU, ActivationFuncType.GATED_SILU]

__all__ = ["GATED_ACTIVATION_TYPES", "ActivationFuncType", "NormType"]
