"""The transformer kernel layer (``deepspeed.ops.transformer``): ``DeepSpeedTransformerConfig`` and
``DeepSpeedTransformerLayer``, a BERT-style encoder layer written in torch with DeepSpeed's options, including
the activation-memory savers (``normalize_invertible``, ``gelu_checkpoint``, ``attn_dropout_checkpoint``)."""

from .config import DeepSpeedTransformerConfig
from .transformer import DeepSpeedTransformerLayer

__all__ = ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer"]
