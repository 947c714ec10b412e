"""``BiasReluOp``: ReLU of ``activations + bias``, computed in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import BaseOp


class BiasReluOp(BaseOp):
    @staticmethod
    def bias_relu_func(activations: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.relu(activations.float() + bias.float()).to(activations.dtype)

    def forward(self, activations: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.bias_relu_func(activations, bias)
