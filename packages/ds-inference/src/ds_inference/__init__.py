"""Inference: init_inference, the InferenceEngine, tensor-parallel inference and weight quantization."""

from __future__ import annotations

from typing import Any

from torch import nn

from ds_inference.__about__ import __version__
from ds_inference._config import build_config, default_inference_config
from ds_inference.engine import InferenceEngine, TokenLimitError

__all__ = ["InferenceEngine", "TokenLimitError", "__version__", "default_inference_config", "init_inference"]


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """Wrap ``model`` for inference (``deepspeed.init_inference``).

    ``config``: a dict, a path to a JSON file, or None; ``kwargs``: the same keys as keyword arguments. A key
    given in both with different values is an error naming the key; otherwise they are merged.
    """
    return InferenceEngine(model, config=build_config(config, **kwargs))
