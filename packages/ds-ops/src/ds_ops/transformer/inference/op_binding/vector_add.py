"""``VectorAddOp``: ``gamma * a + b`` in fp32, rounded to ``a``'s dtype."""

from __future__ import annotations

import torch

from .base import DefaultConfigOp


class VectorAddOp(DefaultConfigOp):
    @staticmethod
    def vector_add_func(a: torch.Tensor, b: torch.Tensor, gamma: float) -> torch.Tensor:
        return (gamma * a.float() + b.float()).to(a.dtype)

    def forward(self, a: torch.Tensor, b: torch.Tensor, gamma: float) -> torch.Tensor:
        return self.vector_add_func(a, b, gamma)
