"""``BiasAddOp``: ``activations + bias`` (the bias broadcast over the last dimension)."""

from __future__ import annotations

import torch

from .base import BaseOp


class BiasAddOp(BaseOp):
    @staticmethod
    def bias_add_func(activations: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return torch.add(activations, bias)

    def forward(self, activations: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.bias_add_func(activations, bias)
