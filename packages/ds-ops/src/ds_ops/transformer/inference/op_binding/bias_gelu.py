"""``BiasGeluOp``: GeLU (tanh approximation, as the kernel) of ``activations + bias``, computed in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import BaseOp


class BiasGeluOp(BaseOp):
    @staticmethod
    def bias_gelu_func(activations: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        summed = activations.float() + bias.float()
        return F.gelu(summed, approximate="tanh").to(activations.dtype)

    def forward(self, activations: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.bias_gelu_func(activations, bias)
