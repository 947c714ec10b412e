"""The transformer kernel layer (``deepspeed.ops.transformer``): ``DeepSpeedTransformerConfig`` and
``DeepSpeedTransformerLayer``, a BERT-style encoder layer written in torch with DeepSpeed's options, including
the activation-memory savers (``normalize_invertible``, ``gelu_checkpoint``, ``attn_dropout_checkpoint``); and the
inference kernels' ``DeepSpeedInferenceConfig`` with their elementwise ops (``inference``)."""

from .config import DeepSpeedTransformerConfig
from .inference.config import DeepSpeedInferenceConfig
from .transformer import DeepSpeedTransformerLayer

__all__ = ["DeepSpeedInferenceConfig", "DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer"]
