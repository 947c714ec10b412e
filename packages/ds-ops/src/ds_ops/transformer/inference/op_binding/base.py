"""``BaseOp``: what every inference op holds, its ``DeepSpeedInferenceConfig``."""

from __future__ import annotations

import torch

from ..config import DeepSpeedInferenceConfig


class BaseOp(torch.nn.Module):
    """An inference op. ``inference_module`` (DeepSpeed's compiled ``InferenceBuilder`` op) stays None: the
    inference kernels are not compiled in this version, every op computes in torch with the kernels' numerics
    (fp32 arithmetic, rounded once to the input dtype)."""

    inference_module = None

    def __init__(self, config: DeepSpeedInferenceConfig) -> None:
        super().__init__()
        self.config = config


class DefaultConfigOp(BaseOp):
    """An op whose config is optional (DeepSpeed builds these with the default ``DeepSpeedInferenceConfig``)."""

    def __init__(self, config: DeepSpeedInferenceConfig | None = None) -> None:
        super().__init__(config if config is not None else DeepSpeedInferenceConfig())
